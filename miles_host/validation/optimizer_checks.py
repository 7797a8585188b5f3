"""``--optimizer`` and ``--optimizer-cpu-offload`` against the chosen training backend,
before anything starts: the trainer class says what it cannot build
(``optimizer_names``, ``cpu_offload_refusal`` on :class:`miles_host.trainer.NativeTrainer`)."""

from __future__ import annotations

from typing import Any


def trainer_class_of(config: Any, registries: Any) -> type | None:
    """The trainer class ``--train-backend`` builds (None: a backend that does not say)."""
    record = registries.train_backends.get(config.train_backend)
    if record.trainer_class is not None:
        return record.trainer_class()
    if config.train_backend == "native":
        from miles_host.trainer import NativeTrainer

        return NativeTrainer
    return None


def check_optimizer_flags(config: Any, registries: Any) -> None:
    """ValueError naming the flag when the backend's trainer cannot honour it."""
    cls = trainer_class_of(config, registries)
    if cls is None:
        return
    names = getattr(cls, "optimizer_names", ("adam",))
    if config.optimizer not in names:
        raise ValueError(f"--optimizer {config.optimizer}: --train-backend {config.train_backend} builds "
                         f"{', '.join(names)} only; give one of them")
    refusal = getattr(cls, "cpu_offload_refusal", None)
    if config.optimizer_cpu_offload and refusal:
        raise ValueError(f"--optimizer-cpu-offload with --train-backend {config.train_backend}: {refusal}; drop the flag")
