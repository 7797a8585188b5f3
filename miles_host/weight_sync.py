"""Weight-sync transports: trainer -> rollout engine after each update."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch


class InProcessTransport:
    """Trainer and engine in one process: hand the tensors over (the engine copies
    them into its own parameters; nothing goes through disk)."""

    def __init__(self, config: Any):
        self.config = config

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], backend: Any, weight_version: Any) -> Any:
        """Load ``named_tensors`` into ``backend``; returns the engine's new version."""
        return backend.update_weights(list(named_tensors), weight_version=weight_version)


class DiskTransport:
    """Write a safetensors file, then have the engine load it (the fallback when
    trainer and engine share no memory or process group)."""

    def __init__(self, config: Any):
        self.config = config

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], backend: Any, weight_version: Any) -> Any:
        """Write to ``<output_dir>/weight_sync/model.safetensors`` and load it."""
        from safetensors.torch import load_file, save_file

        directory = Path(self.config.output_dir) / "weight_sync"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "model.safetensors"
        save_file({name: t.detach().contiguous().cpu() for name, t in named_tensors}, str(path))
        return backend.update_weights(load_file(str(path)), weight_version=weight_version)
