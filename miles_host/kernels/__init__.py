"""Fused inference kernels (Triton) for the engine's decode and prefill forwards.

Each kernel has a plain-PyTorch reference that runs anywhere and is the
oracle of its GPU test (``tests/models/test_fused_kernels.py``). The fused
kernels reproduce the eager modules' bf16 rounding steps, so they differ
from the eager forward only in the order of the RMS reduction.
In a graph that needs gradients their backward is the reference's
(:mod:`~miles_host.kernels.eager_backward`): the batch-invariant trainer runs them;
the default trainer keeps the eager (or compiled) modules.
:mod:`~miles_host.kernels.split_k` plans and reduces the split-K launches of the
quantization plugins' small-M (decode) GEMMs.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache

import torch


@lru_cache(maxsize=None)
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def fused_kernels_usable(device: torch.device) -> bool:
    """Whether the Triton fused kernels can run on ``device``."""
    return device.type == "cuda" and torch.cuda.is_available() and triton_importable()
