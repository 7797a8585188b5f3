"""``miles run`` beyond one process, on one node.

``--actor-num-gpus-per-node N`` trainers (rank 0 in this process; on CPU a "GPU"
is a process), ``--rollout-num-gpus M`` rollout engines of
``--rollout-num-gpus-per-engine`` each (engines = M / per-engine), all started with
``torch.multiprocessing`` spawn. The RL loop (:class:`miles_host.loop.Run`) runs in
this process unchanged: it sees a :class:`TrainerGroup` as its trainer and a
:class:`RolloutRouter` as its rollout backend.

Placement on GPUs: disaggregated, trainer ``i`` on ``cuda:i`` and engine ``j`` on
``cuda:<trainers + j>``. ``--colocate``: engine ``j`` shares a trainer's GPU (one engine
per trainer GPU unless ``--rollout-num-gpus`` divides their number), the phases take
turns on it (:mod:`miles_host.phases`) and weights go by CUDA IPC. On CPU a "GPU" is a
process either way.

Faults: every wait on a worker checks that the process lives and gives up after
``--worker-timeout`` seconds; the run then writes a checkpoint of the last
completed rollout (``--save``), stops every worker and exits with code 3 and a
message naming the worker.

Several nodes (``--actor-num-nodes > 1``, through Ray): workers are placed with a SPREAD
placement group; process groups meet at :func:`rendezvous_address` (the driver's address
that other nodes reach).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from typing import Any

import torch

from miles_host.distributed.comm import WorkerHandle, free_port
from miles_host.distributed.errors import WorkerFailed

DEFAULT_WORKER_TIMEOUT_S = 120.0
#: exit code of a run stopped by a worker failure
WORKER_FAILED_EXIT = 3


def worker_timeout(config: Any) -> float:
    return float(getattr(config, "worker_timeout", None) or DEFAULT_WORKER_TIMEOUT_S)


def num_trainers(config: Any) -> int:
    return int(config.actor_num_nodes) * int(config.actor_num_gpus_per_node)


def num_engines(config: Any) -> int:
    """Rollout engines: ``--rollout-num-gpus`` / per engine; colocated, one per trainer GPU by default."""
    gpus = config.rollout_num_gpus or (num_trainers(config) if config.colocate else 0)
    return max(1, gpus // max(1, config.rollout_num_gpus_per_engine)) if gpus else 0


def on_gpus(config: Any) -> bool:
    return torch.cuda.is_available() and str(config.device) != "cpu"


def engine_gpu(config: Any, index: int) -> int:
    """The GPU of rollout engine ``index``: after the trainers' (disaggregated), or shared
    with trainer ``index * trainers / engines`` (``--colocate``, engines spread evenly)."""
    if config.colocate:
        return index * (num_trainers(config) // max(1, num_engines(config)))
    return num_trainers(config) + index


def wants_distributed(config: Any) -> bool:
    """True when the run needs more than this one process."""
    return (
        uses_ray(config)
        or num_trainers(config) > 1
        or (config.rollout_num_gpus or 0) > 1
        or config.rollout_backend == "process"
        or config.train_backend in ("native_dp", "fsdp")
    )


def check_placement(config: Any) -> None:
    """The placement flags this launcher can honour (raises ValueError otherwise)."""
    if uses_ray(config):
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ValueError(
                "--use-ray / --actor-num-nodes > 1 place workers with Ray placement groups: pip install ray"
            ) from None
    if config.rollout_num_gpus_per_engine != 1:
        raise ValueError(
            f"--rollout-num-gpus-per-engine {config.rollout_num_gpus_per_engine}: the embedded engine has no "
            "tensor parallelism; use 1 (one engine per GPU) or the sglang backend"
        )
    if config.colocate:
        check_colocation(config)
    if on_gpus(config):
        trainers, engines = num_trainers(config), num_engines(config)
        need = trainers if config.colocate else trainers + engines  # shared GPUs count once
        if need > torch.cuda.device_count():
            what = f"{trainers} trainer(s) sharing their GPUs with {engines} engine(s)" if config.colocate else (
                f"{trainers} trainer(s) + {engines} engine(s)")
            raise ValueError(f"{what} need {need} GPUs, this node has {torch.cuda.device_count()}")


def check_colocation(config: Any) -> None:
    """``--colocate``: every engine shares a trainer's GPU, and the engines spread evenly."""
    if uses_ray(config):
        raise ValueError("--colocate with --use-ray / several nodes is not supported yet; colocate on one node without Ray")
    trainers, gpus = num_trainers(config), config.rollout_num_gpus
    if gpus and (gpus > trainers or trainers % gpus):
        raise ValueError(
            f"--colocate puts the rollout engines on the trainers' GPUs: --rollout-num-gpus {gpus} cannot share "
            f"the {trainers} trainer GPU(s) (--actor-num-nodes x --actor-num-gpus-per-node) evenly; use {trainers} "
            "(one engine per trainer GPU, the default with --colocate) or a number that divides it"
        )
    if on_gpus(config) and config.weight_sync == "broadcast":
        raise ValueError(
            "--colocate --weight-sync broadcast: NCCL cannot broadcast between two processes on one GPU; "
            "use --weight-sync cuda_ipc (the default with --colocate) or disk"
        )


def _threads(config: Any) -> int:
    import os

    return max(1, (os.cpu_count() or 1) // max(1, num_trainers(config) + num_engines(config)))


#: workers started by this process and not stopped yet
_LIVE: list[WorkerHandle] = []


def rendezvous_address(config: Any) -> str:
    """Where process groups meet (the driver's TCP store): an address of this host that
    workers on other nodes reach when the run spans nodes, loopback otherwise."""
    if int(config.actor_num_nodes) > 1:
        from miles_host.distributed.ray_workers import driver_address

        return driver_address()
    return "127.0.0.1"


def uses_ray(config: Any) -> bool:
    """Workers as Ray actors: ``--use-ray`` or more than one node."""
    return bool(getattr(config, "use_ray", False)) or config.actor_num_nodes > 1


def _spawn(target, name: str, args: tuple, timeout_s: float, config: Any = None, index: int = 0):
    if config is not None and uses_ray(config):
        from miles_host.distributed.ray_workers import spawn_ray

        process, parent = spawn_ray(target, name, args, timeout_s, config, index)
    else:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=target, args=(*args, child), name=name, daemon=True)
        process.start()
        child.close()
    handle = WorkerHandle(name, process, parent, timeout_s)
    _LIVE.append(handle)
    return handle


# -- registry factories ------------------------------------------------------------


def make_trainer(config: Any, manager: Any):
    """``--train-backend native_dp`` / ``fsdp``: N data-parallel trainers (``--actor-num-gpus-per-node``),
    replicated or FSDP2-sharded."""
    from miles_host.distributed.trainer_group import TrainerGroup, device_for_rank, group_backend, trainer_class_for

    trainer_class = trainer_class_for(config, manager)
    world, timeout_s = num_trainers(config), worker_timeout(config)
    if world == 1 and not trainer_class.collective_state_dict:
        return trainer_class(config, manager)
    rank0_config = copy.copy(config)
    rank0_config.device = device_for_rank(config, 0)  # "cuda" -> "cuda:0", as the other ranks get theirs
    address, port = rendezvous_address(config), free_port()
    handles = []
    try:
        for rank in range(1, world):
            # trainer_main(config, rank, world, (address, port), conn, num_threads, timeout_s): conn goes last via _spawn
            handles.append(_spawn(_trainer_entry, f"trainer-{rank}", (config, rank, world, (address, port), _threads(config), timeout_s),
                                  timeout_s, config, rank - 1))
        from miles_host.distributed.comm import new_group

        group = new_group(address, port, 0, world, group_backend(config), timeout_s,
                          as_default=trainer_class.collective_state_dict)
        local = trainer_class(rank0_config, manager, group, 0, world)
    except BaseException:
        _stop_all(handles)
        raise
    _await_startup(handles)
    return TrainerGroup(local, handles)


def _stop_all(handles: list) -> None:
    for handle in handles:
        handle.stop(1)


def _await_startup(handles: list) -> None:
    """Wait for every worker's start-up answer; stop them all if one fails."""
    try:
        for handle in handles:
            handle.recv("its start-up")
    except BaseException:
        _stop_all(handles)
        raise


def _trainer_entry(config, rank, world, store_address, num_threads, timeout_s, conn):
    from miles_host.distributed.trainer_group import trainer_main

    trainer_main(config, rank, world, store_address, conn, num_threads, timeout_s)


def _rollout_entry(config, index, num_threads, conn):
    from miles_host.distributed.rollout_worker import rollout_main

    rollout_main(config, index, conn, num_threads)


def make_rollout(config: Any, manager: Any):
    """``--rollout-backend process``: engines in their own processes behind a router."""
    from miles_host.distributed.rollout_worker import RolloutClient, RolloutRouter

    count, timeout_s = max(1, num_engines(config)), worker_timeout(config)
    handles = []
    try:
        for index in range(count):
            engine_config = copy.copy(config)
            if on_gpus(config):
                engine_config.device = f"cuda:{engine_gpu(config, index)}"
            handles.append(_spawn(_rollout_entry, f"rollout-{index}", (engine_config, index, _threads(config)), timeout_s,
                                  config, num_trainers(config) - 1 + index))
    except BaseException:
        _stop_all(handles)
        raise
    _await_startup(handles)
    return RolloutRouter([RolloutClient(handle) for handle in handles])


# -- the run -------------------------------------------------------------------------


def _stop_workers(run: Any = None) -> None:
    """Stop every worker this process started (those of ``run`` and any left over
    by a launch that failed half way)."""
    while _LIVE:
        handle = _LIVE.pop()
        with contextlib.suppress(Exception):
            handle.stop()
    from miles_host.distributed.comm import leave_default_group

    leave_default_group()  # a sharded trainer's group in this process
    import sys

    if "miles_host.distributed.ray_workers" in sys.modules:
        sys.modules["miles_host.distributed.ray_workers"].shutdown()


def prepare(config: Any) -> None:
    """The process defaults: engines in processes, data-parallel trainers, broadcast sync
    (CUDA IPC when colocated on GPUs: trainer rank 0 and engine 0 share a device)."""
    if config.rollout_backend == "embedded":
        config.rollout_backend = "process"
    if config.train_backend == "native":
        config.train_backend = "native_dp"
    if config.weight_sync == "inprocess":
        config.weight_sync = "cuda_ipc" if config.colocate and on_gpus(config) else "broadcast"


def make_run(config: Any, manager: Any):
    """A :class:`miles_host.loop.Run` over processes (call ``stop_workers(run)`` after)."""
    from miles_host.loop import Run

    prepare(config)
    run = Run(config, manager)
    _track_trained(run)
    return run


def _track_trained(run: Any) -> None:
    """``run._trained_unlogged``: the trainer moved past the last logged rollout
    (a checkpoint written now would mix states)."""
    run._trained_unlogged = False
    train, log = run.trainer.train, run.log

    def tracked_train(samples):
        run._trained_unlogged = True
        return train(samples)

    def tracked_log(metrics, step):
        log(metrics, step)
        run._trained_unlogged = False

    run.trainer.train, run.log = tracked_train, tracked_log


def stop_workers(run: Any) -> None:
    _stop_workers(run)


def run_distributed(config: Any, manager: Any) -> int:
    """``miles run`` with trainers and / or engines in other processes."""
    from miles_host.loop import NanLossError

    run = None
    try:
        run = make_run(config, manager)
        return run.run()
    except WorkerFailed as error:
        message = f"miles: error: {error}; the run stopped"
        if run is not None and config.save:
            message += "; " + _final_checkpoint(run, config)
        print(message, file=sys.stderr)
        return WORKER_FAILED_EXIT
    except NanLossError as error:
        print(f"miles: error: {error}", file=sys.stderr)
        return 1
    finally:
        _stop_workers(run)


def _final_checkpoint(run: Any, config: Any) -> str:
    """Write the checkpoint of the last completed rollout when the state is clean;
    say where the newest usable checkpoint is."""
    from pathlib import Path

    from miles_host.checkpoint import LATEST

    last = run_last_completed(run)
    latest_file = Path(config.save) / LATEST
    on_disk = int(latest_file.read_text().strip()) if latest_file.is_file() else -1
    if last >= 0 and last > on_disk and not run._trained_unlogged:
        try:
            run.checkpoint(last)
            return f"checkpoint of rollout {last} written to {config.save} (resume with --load {config.save})"
        except Exception as error:  # noqa: BLE001
            return f"writing the checkpoint of rollout {last} failed ({error})"
    if on_disk >= 0:
        return f"last checkpoint: rollout {on_disk} in {config.save} (resume with --load {config.save})"
    return "no rollout had completed, no checkpoint written"


def run_last_completed(run: Any) -> int:
    """The last rollout whose step finished (its metrics were logged)."""
    history = [m for m in run.state.history if m.get("rollout_id", -1) >= 0]
    return int(history[-1]["rollout_id"]) if history else run.state.rollout_id - 1
