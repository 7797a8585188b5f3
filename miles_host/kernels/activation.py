"""``silu(gate) * up`` of a fused gate/up projection in one kernel.

Reference: :func:`silu_and_mul_reference` (the eager :class:`~miles_host.models.mlp.GatedMLP` math).
Tensor legend: T tokens, I intermediate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_reference(gate_up_T2I: torch.Tensor) -> torch.Tensor:
    gate_TI, up_TI = gate_up_T2I.chunk(2, dim=-1)
    return F.silu(gate_TI) * up_TI


def silu_and_mul(gate_up_T2I: torch.Tensor) -> torch.Tensor:
    """Fused on CUDA for a 2-D row-contiguous input; the reference otherwise.
    Differentiable (the reference's gradient, :mod:`~miles_host.kernels.eager_backward`)."""
    if not gate_up_T2I.is_cuda or gate_up_T2I.dim() != 2 or gate_up_T2I.stride(-1) != 1:
        return silu_and_mul_reference(gate_up_T2I)
    from miles_host.kernels import _activation_triton
    from miles_host.kernels.eager_backward import fused_with_eager_backward

    return fused_with_eager_backward(_activation_triton.silu_and_mul, silu_and_mul_reference, gate_up_T2I)
