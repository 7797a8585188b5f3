"""Built-in plugin ``builtin-distributed``: the multi-process pieces of the host —
training backend ``native_dp`` (data parallel over processes), rollout backend
``process`` (engines in their own processes) and weight-sync transports
``broadcast`` and ``cuda_ipc``. ``miles run`` switches to them when a run needs
more than one process (see :mod:`miles_host.distributed.launcher`)."""

from __future__ import annotations

from miles_host.builtin.rollout import check_engine_sequences
from miles_host.builtin.train import check_native_trainer
from miles_host.distributed.placement import check_broadcast
from miles_host.records import RolloutBackend, TrainBackend, WeightSyncTransport


def _dp(config, manager):
    from miles_host.distributed.launcher import make_trainer

    return make_trainer(config, manager)


def _replicated():
    from miles_host.distributed.dp_trainer import DataParallelTrainer

    return DataParallelTrainer


def _sharded():
    from miles_host.distributed.fsdp_trainer import Fsdp2Trainer

    return Fsdp2Trainer


def _process(config, manager):
    from miles_host.distributed.launcher import make_rollout

    return make_rollout(config, manager)


def _broadcast(config):
    from miles_host.distributed.transports import BroadcastTransport

    return BroadcastTransport(config)


def _ipc(config):
    from miles_host.distributed.transports import IpcTransport

    return IpcTransport(config)


def miles_register_train_backends():
    """``native_dp`` and ``fsdp``."""
    return [
        TrainBackend(
            "native_dp", "native trainer, data-parallel over --actor-num-gpus-per-node processes (gloo/NCCL)",
            factory=_dp, trainer_class=_replicated, multi_process=True, validate=check_native_trainer, lora=True,
        ),
        TrainBackend(
            "fsdp", "native trainer with FSDP2 (fully_shard per decoder layer) over --actor-num-gpus-per-node processes",
            factory=_dp, trainer_class=_sharded, multi_process=True, validate=check_native_trainer, lora=True,
        ),
    ]


def miles_register_rollout_backends():
    """``process``."""
    return [RolloutBackend("process", "embedded engines in their own processes (--rollout-num-gpus), RPC over pipes",
                           factory=_process, multi_process=True, validate=check_engine_sequences,
                           fault_tolerant=True)]


def miles_register_weight_sync_transports():
    """``broadcast`` and ``cuda_ipc``."""
    return [
        WeightSyncTransport("broadcast", "bucketed torch.distributed broadcast (NCCL on GPU, gloo on CPU)", factory=_broadcast,
                            validate=check_broadcast),
        WeightSyncTransport("cuda_ipc", "CUDA IPC memory handles (shared memory on CPU)", factory=_ipc),
    ]
