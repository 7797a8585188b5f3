"""Between benchmark cases: wait for the GPU's queued work, and give a freed engine's memory back."""

from __future__ import annotations

import gc

import torch


def sync(device: str) -> None:
    """Wait for the work queued on ``device`` (a no-op off CUDA): timings then cover the GPU's work."""
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    """Collect a freed engine's objects and return its cached blocks to the driver. The engine
    ``gc.freeze()``s the heap on CUDA; unfreezing lets a freed engine's cycles be collected."""
    gc.unfreeze()
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
