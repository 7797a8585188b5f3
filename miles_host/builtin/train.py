"""Built-in plugin: the native PyTorch training backend."""

from __future__ import annotations

from miles_host.records import TrainBackend


def _native(config, manager):
    from miles_host.trainer import NativeTrainer

    return NativeTrainer(config, manager)


def miles_register_train_backends():
    """The native trainer (one process; FSDP2 across GPUs)."""
    return [TrainBackend("native", "native PyTorch trainer over the shared model code", factory=_native)]
