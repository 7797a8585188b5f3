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
message naming the worker. With ``--use-fault-tolerance`` a rollout engine that dies
or stops beating its heartbeat is restarted instead
(:mod:`miles_host.distributed.engine_restarts`); a trainer failure still stops the run.

Several nodes (``--actor-num-nodes > 1``, through Ray): workers are placed with a SPREAD
placement group; process groups meet at :func:`rendezvous_address` (the driver's address
that other nodes reach).
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from miles_host.checkpoint import LATEST
from miles_host.distributed import ray_workers
from miles_host.distributed.comm import WorkerHandle, free_port, leave_default_group, new_group
from miles_host.distributed.errors import WorkerFailed
from miles_host.distributed.engine_restarts import RestartingRouter, RestartingTransport
from miles_host.distributed.failures import failed_worker
from miles_host.distributed.heartbeat import Heartbeat
from miles_host.distributed.placement import (
    engine_gpu,
    num_engines,
    num_trainers,
    on_gpus,
    prepare,
    uses_ray,
    wants_distributed,
    worker_timeout,
)
from miles_host.distributed.ray_workers import rendezvous_address
from miles_host.distributed.rollout_worker import RolloutClient, RolloutRouter, rollout_main
from miles_host.distributed.trainer_group import TrainerGroup, device_for_rank, group_backend, trainer_class_for, trainer_main
from miles_host.fully_async.run import FullyAsyncRun
from miles_host.loop import NanLossError, Run

#: exit code of a run stopped by a worker failure
WORKER_FAILED_EXIT = 3


def _threads(config: Any) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, num_trainers(config) + num_engines(config)))


#: workers started by this process and not stopped yet
_LIVE: list[WorkerHandle] = []


def _spawn(target, name: str, args: tuple, timeout_s: float, config: Any = None, index: int = 0,
           heartbeat: Heartbeat | None = None):
    """Start ``target(*args, [heartbeat,] conn)`` (the heartbeat argument only when one is
    given; Ray workers get None: their hangs are found by ``--worker-timeout``)."""
    if config is not None and uses_ray(config):
        extra = () if heartbeat is None else (None,)
        process, parent = ray_workers.spawn_ray(target, name, (*args, *extra), timeout_s, config, index)
        heartbeat = None
    else:
        ctx = mp.get_context("spawn")
        if heartbeat is not None:
            args = (*args, heartbeat)
        parent, child = ctx.Pipe()
        process = ctx.Process(target=target, args=(*args, child), name=name, daemon=True)
        process.start()
        child.close()
    handle = WorkerHandle(name, process, parent, timeout_s, heartbeat)
    _LIVE.append(handle)
    return handle


# -- registry factories ------------------------------------------------------------


def make_trainer(config: Any, manager: Any):
    """A trainer group of ``--actor-num-gpus-per-node`` ranks of the training backend's
    ``trainer_class`` (``native_dp``: replicated, ``fsdp``: FSDP2-sharded, a plugin's own)."""
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
        try:
            group = new_group(address, port, 0, world, group_backend(config), timeout_s,
                              as_default=trainer_class.collective_state_dict)
            local = trainer_class(rank0_config, manager, group, 0, world)
        except RuntimeError as error:  # DistStoreError / a broken broadcast: a rank died or never joined
            raise failed_worker(handles, "its start-up", error, "trainer-0") from error
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
    trainer_main(config, rank, world, store_address, conn, num_threads, timeout_s)


def _rollout_entry(config, index, num_threads, incarnation, *rest):
    *heartbeat, conn = rest
    rollout_main(config, index, conn, num_threads, heartbeat[0] if heartbeat else None, incarnation)


def _spawn_engine(config: Any, index: int, incarnation: int = 0) -> WorkerHandle:
    """Start rollout engine ``index`` on its device (``incarnation``: its restarts so far);
    with ``--use-fault-tolerance`` it beats a heartbeat."""
    engine_config = copy.copy(config)
    if on_gpus(config):
        engine_config.device = f"cuda:{engine_gpu(config, index)}"
    heartbeat = None
    if config.use_fault_tolerance:
        heartbeat = Heartbeat(mp.get_context("spawn"), config.rollout_health_check_interval,
                              config.rollout_health_check_timeout, config.rollout_health_check_first_wait)
    return _spawn(_rollout_entry, f"rollout-{index}", (engine_config, index, _threads(config), incarnation),
                  worker_timeout(config), config, num_trainers(config) - 1 + index, heartbeat)


def _respawn_engines(config: Any, incarnations: dict[int, int]) -> dict[int, RolloutClient]:
    """Started engine processes in place of failed engines (``{index: incarnation}``), all
    started before any is waited for."""
    handles = {}
    try:
        for index, incarnation in incarnations.items():
            handles[index] = _spawn_engine(config, index, incarnation)
    except BaseException:
        _stop_all(list(handles.values()))
        raise
    _await_startup(list(handles.values()))
    return {index: RolloutClient(handle) for index, handle in handles.items()}


def make_rollout(config: Any, manager: Any):
    """``--rollout-backend process``: engines in their own processes behind a router
    (one that restarts failed engines with ``--use-fault-tolerance``)."""
    count = max(1, num_engines(config))
    handles = []
    try:
        for index in range(count):
            handles.append(_spawn_engine(config, index))
    except BaseException:
        _stop_all(handles)
        raise
    _await_startup(handles)
    clients = [RolloutClient(handle) for handle in handles]
    if config.use_fault_tolerance:
        return RestartingRouter(clients, lambda incarnations: _respawn_engines(config, incarnations),
                                config.max_engine_restarts)
    return RolloutRouter(clients)


# -- the run -------------------------------------------------------------------------


def _stop_workers(run: Any = None) -> None:
    """Stop every worker this process started (those of ``run`` and any left over
    by a launch that failed half way). All are asked first, so they exit side by side."""
    for handle in _LIVE:
        with contextlib.suppress(Exception):
            if handle.process.is_alive():
                handle.conn.send(("stop", ()))
    while _LIVE:
        handle = _LIVE.pop()
        with contextlib.suppress(Exception):
            handle.stop()
    leave_default_group()  # a sharded trainer's group in this process
    ray_workers.shutdown()  # no-op unless this run placed workers with Ray


def new_run(config: Any, manager: Any) -> Run:
    """The run ``config`` asks for: synchronous, or ``--fully-async``."""
    return (FullyAsyncRun if config.fully_async else Run)(config, manager)


def make_run(config: Any, manager: Any) -> Run:
    """A :class:`miles_host.loop.Run` over processes (call ``stop_workers(run)`` after)."""
    prepare(config, manager.registries)
    run = new_run(config, manager)
    if isinstance(run.backend, RestartingRouter):
        transport = run.transport
        run.backend.restore_weights = lambda: push_current_weights(run, transport)
        run.transport = RestartingTransport(transport, run.backend)
    return run


def push_current_weights(run: Run, transport: Any) -> Any:
    """Push the trainer's weights as the run's current version through ``transport`` (a
    restarted engine's first weights: all of them, whatever ``--lora-sync`` sends later)."""
    return transport.push(list(run.trainer.named_weights_for_rollout()), run.backend, run.state.weight_version)


def stop_workers(run: Any) -> None:
    _stop_workers(run)


def run_training(config: Any, manager: Any) -> int:
    """Entry point of ``miles run`` (after the config is resolved): the loop in this
    process, or over trainer and engine processes when the run needs them."""
    if wants_distributed(config, manager.registries):
        return run_distributed(config, manager)
    run = new_run(config, manager)
    try:
        return run.run()
    except NanLossError as error:
        print(f"miles: error: {error}", file=sys.stderr)
        return 1
    finally:
        run.close()


def run_distributed(config: Any, manager: Any) -> int:
    """``miles run`` with trainers and / or engines in other processes."""
    run = None
    try:
        run = make_run(config, manager)
        return run.run()
    except WorkerFailed as error:
        message = f"miles: error: {error}; the run stopped"
        if run is not None and config.save:
            message += "; " + _final_checkpoint(run, config, error)
        print(message, file=sys.stderr)
        return WORKER_FAILED_EXIT
    except NanLossError as error:
        print(f"miles: error: {error}", file=sys.stderr)
        return 1
    finally:
        _stop_workers(run)


def _final_checkpoint(run: Run, config: Any, failure: WorkerFailed) -> str:
    """Write the checkpoint of the last completed rollout when the trainer's state is
    that rollout's (it has not trained since, or ``failure`` came before its first
    optimizer step of the next one), or of the next rollout when its training finished
    and only what came after failed; say where the newest usable checkpoint is."""
    last = run_last_completed(run)
    latest_file = Path(config.save) / LATEST
    on_disk = int(latest_file.read_text().strip()) if latest_file.is_file() else -1
    positions = run.step_start  # mid-step: the data position where the unfinished step began
    if run.trained_unlogged and run.trained_rollout == last + 1:  # trained, then failed (weight sync)
        last, positions = last + 1, None
    elif run.trained_unlogged and not failure.trainer_state_unchanged:
        last = -1  # the trainer took part of a rollout's optimizer steps: its state is of no rollout
    if last >= 0 and last > on_disk:
        try:
            run.checkpoint(last, positions)
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
