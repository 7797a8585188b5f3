"""``--device`` and ``--dtype``: what ``auto`` resolves to."""

from __future__ import annotations

from typing import Any

import torch


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
