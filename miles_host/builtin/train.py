"""Built-in plugin: the native PyTorch training backend."""

from __future__ import annotations

from typing import Any

from miles_host.distributed.placement import num_trainers
from miles_host.records import TrainBackend

#: model-parallel fields the native trainer (one model replica per process) cannot honour
MODEL_PARALLEL_FLAGS = {
    "tensor_model_parallel_size": "--tensor-model-parallel-size",
    "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
    "expert_model_parallel_size": "--expert-model-parallel-size",
    "context_parallel_size": "--context-parallel-size",
}


def check_native_trainer(config: Any, registries: Any) -> None:
    """``TrainBackend.validate`` of the native trainers: no model parallelism, so the
    parallel sizes stay 1 and ``--sequence-parallel`` (which splits the sequence over
    tensor-parallel ranks) is refused; over several trainer processes (data parallel)
    no critic, whose gradients are not all-reduced."""
    for name, flag in MODEL_PARALLEL_FLAGS.items():
        value = getattr(config, name)
        if value != 1:
            raise ValueError(
                f"{flag} {value} is not supported by --train-backend {config.train_backend} (no model "
                "parallelism); use --train-backend megatron (plugin miles-megatron), or drop the flag"
            )
    if config.sequence_parallel:
        raise ValueError(
            f"--sequence-parallel splits the sequence over tensor-parallel ranks, which --train-backend "
            f"{config.train_backend} does not have; use --train-backend megatron --tensor-model-parallel-size N "
            "(plugin miles-megatron), or drop --sequence-parallel"
        )
    estimator = registries.advantage_estimators.get(config.advantage_estimator)
    if num_trainers(config) > 1 and estimator.needs_critic:
        raise ValueError(
            f"--advantage-estimator {config.advantage_estimator} trains a critic, which the data-parallel trainer "
            "does not all-reduce yet; use one trainer process or a critic-free estimator (grpo, gspo, rloo, ...)"
        )


def _native(config, manager):
    from miles_host.trainer import NativeTrainer

    return NativeTrainer(config, manager)


def miles_register_train_backends():
    """The native trainer (one process; FSDP2 across GPUs)."""
    return [TrainBackend("native", "native PyTorch trainer over the shared model code", factory=_native,
                         validate=check_native_trainer, distributed_variant="native_dp", lora=True)]
