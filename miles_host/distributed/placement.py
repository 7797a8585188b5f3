"""Where a run's processes go, from the config and the selected records alone.

How many trainer and engine processes a run has, which GPU each gets, whether the run
needs more than this one process, and the placement flags a multi-process run can
honour. Nothing here starts a process (:mod:`miles_host.distributed.launcher` does), so
the validation stage and plugins can ask these questions before anything runs.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

DEFAULT_WORKER_TIMEOUT_S = 120.0


def worker_timeout(config: Any) -> float:
    """``--worker-timeout`` seconds (the default when unset)."""
    return float(config.worker_timeout or DEFAULT_WORKER_TIMEOUT_S)


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


def uses_ray(config: Any) -> bool:
    """Workers as Ray actors: ``--use-ray`` or more than one node."""
    return bool(config.use_ray) or config.actor_num_nodes > 1


def placement_needs_processes(config: Any) -> bool:
    """The placement flags alone ask for more than one process (Ray, several trainers or engines)."""
    return uses_ray(config) or num_trainers(config) > 1 or (config.rollout_num_gpus or 0) > 1


def wants_distributed(config: Any, registries: Any) -> bool:
    """True when the run needs more than this one process: its placement flags ask for it,
    ``--use-fault-tolerance`` with a backend whose engines can move to processes (``embedded``:
    a restarted engine needs a process of its own), or the selected rollout or training
    backend's record is ``multi_process``."""
    rollout = registries.rollout_backends.get(config.rollout_backend)
    return (
        placement_needs_processes(config)
        or (bool(config.use_fault_tolerance) and bool(rollout.distributed_variant))
        or rollout.multi_process
        or registries.train_backends.get(config.train_backend).multi_process
    )


def check_placement(config: Any) -> None:
    """The placement flags a multi-process run can honour (raises ValueError otherwise)."""
    if uses_ray(config) and importlib.util.find_spec("ray") is None:
        raise ValueError("--use-ray / --actor-num-nodes > 1 place workers with Ray placement groups: pip install ray")
    if config.colocate:
        check_colocation(config)
    if on_gpus(config):
        trainers, engines = num_trainers(config), num_engines(config)
        # shared GPUs count once; an engine takes --rollout-num-gpus-per-engine GPUs (SGLang's tensor parallelism;
        # the engine backends refuse more than one in their validation)
        need = trainers if config.colocate else trainers + engines * max(1, config.rollout_num_gpus_per_engine)
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


def check_broadcast(config: Any, registries: Any) -> None:
    """``WeightSyncTransport.validate`` of ``broadcast``: NCCL cannot reach a process on one's own GPU."""
    if config.colocate and on_gpus(config):
        raise ValueError(
            "--colocate --weight-sync broadcast: NCCL cannot broadcast between two processes on one GPU; "
            "use --weight-sync cuda_ipc (the default with --colocate) or disk"
        )


def prepare(config: Any, registries: Any) -> None:
    """The multi-process defaults, from the selected records: a rollout or training backend
    that runs in this process gives way to its ``distributed_variant`` (``embedded`` ->
    ``process``, ``native`` -> ``native_dp``), and an ``in_process_only`` transport to CUDA
    IPC when colocated on GPUs (trainer rank 0 and engine 0 share a device), else broadcast."""
    rollout = registries.rollout_backends.get(config.rollout_backend)
    if not rollout.multi_process and rollout.distributed_variant:
        config.rollout_backend = rollout.distributed_variant
    train = registries.train_backends.get(config.train_backend)
    if not train.multi_process and train.distributed_variant:
        config.train_backend = train.distributed_variant
    if registries.weight_sync_transports.get(config.weight_sync).in_process_only:
        config.weight_sync = "cuda_ipc" if config.colocate and on_gpus(config) else "broadcast"
