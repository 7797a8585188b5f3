"""``--device`` and ``--dtype``: what ``auto`` resolves to; small host -> device copies that
do not wait for the GPU, and the host values they came from.

A copy from pageable host memory to a CUDA device first waits for the stream's queued
work (the GPU's queue drains, and the host's next launches find it idle); from pinned
memory (PyTorch's caching host allocator) it does not. :func:`host_to_device` copies from
pinned memory and, asked to, remembers the host tensor, so :func:`host_values` gives a
tensor's values on the host without reading the device (a packed batch's sequence bounds and positions,
built on the host, read there again by the attention and the Megatron layout).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

#: device tensor -> the host tensor :func:`host_to_device` copied it from (while the device tensor lives)
_HOST_SOURCES = WeakIdKeyDictionary()


def resolve_device(config: Any) -> torch.device:
    """``--device auto``: CUDA when available, else CPU."""
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {config.device} asked for, but no CUDA device is available; use --device cpu")
    return torch.device(config.device)


def resolve_dtype(config: Any, device: torch.device) -> torch.dtype:
    """``--dtype auto``: bf16 on GPU, float32 on CPU."""
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, config.dtype)


def host_to_device(tensor: torch.Tensor, device: torch.device | str, keep_host: bool = False) -> torch.Tensor:
    """``tensor`` on ``device``; a host tensor goes to a CUDA device through pinned memory,
    without waiting for the GPU (module doc). ``keep_host``: :func:`host_values` of the result is
    ``tensor`` itself (the result must then not be written in place)."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    copied = tensor.pin_memory().to(device, non_blocking=True)
    if keep_host:
        _HOST_SOURCES[copied] = tensor
    return copied


def host_values(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values on the host: itself on the CPU, the host tensor :func:`host_to_device`
    copied it from, else a copy read from the device (which waits for the GPU)."""
    if tensor.device.type == "cpu":
        return tensor
    source = _HOST_SOURCES.get(tensor)
    return source if source is not None else tensor.cpu()
