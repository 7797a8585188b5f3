"""Weight-sync transports to SGLang servers.

- ``sglang_tensor``: buckets of ``--update-weight-buffer-size`` bytes through
  ``/update_weights_from_tensor`` (safetensors-encoded on CPU, CUDA IPC handles
  with ``--sglang-weight-encoding cuda_ipc`` on a colocated GPU).
- ``sglang_disk``: an HF checkpoint in ``<output_dir>/weight_sync`` and
  ``/update_weights_from_disk`` (servers on the same filesystem; the fallback).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Iterable

import torch


def _sglang_backend(backend: Any, transport: str) -> Any:
    if not hasattr(backend, "clients"):
        raise ValueError(f"--weight-sync {transport} needs --rollout-backend sglang (got {type(backend).__name__})")
    return backend


class TensorTransport:
    """Bucketed ``/update_weights_from_tensor`` pushes."""

    def __init__(self, config: Any):
        self.config = config

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], backend: Any, weight_version: Any) -> Any:
        """Send every tensor, the last bucket carrying ``weight_version``."""
        return _sglang_backend(backend, "sglang_tensor").update_weights(named_tensors, weight_version=weight_version)


class DiskTransport:
    """Save an HF checkpoint, then ``/update_weights_from_disk`` on every server."""

    def __init__(self, config: Any):
        self.config = config

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], backend: Any, weight_version: Any) -> Any:
        """Write ``model.safetensors`` (HF names) + ``config.json`` and have the servers load it."""
        from safetensors.torch import save_file

        from miles_sglang.weights import native_to_hf

        backend = _sglang_backend(backend, "sglang_disk")
        directory = Path(self.config.output_dir) / "weight_sync"
        directory.mkdir(parents=True, exist_ok=True)
        named = native_to_hf([(n, t.detach()) for n, t in named_tensors], backend.family, backend.model_config)
        tensors = {name: t.contiguous().cpu() for name, t in named}
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        shutil.copyfile(Path(self.config.hf_checkpoint) / "config.json", directory / "config.json")
        body = {"model_path": str(directory.resolve()), "weight_version": None if weight_version is None else str(weight_version)}
        for client in backend.clients:
            answer = client.request("POST", "/update_weights_from_disk", body)
            if isinstance(answer, dict) and answer.get("success") is False:
                raise RuntimeError(f"{client.url}/update_weights_from_disk failed: {answer.get('message')}")
        backend._weight_version = weight_version
        return weight_version
