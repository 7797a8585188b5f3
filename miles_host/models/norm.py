"""RMSNorm in the two forms the families use.

Llama form: ``w * (x_fp32 * rsqrt(mean(x^2) + eps)).to(dtype)``.
Gemma form (``unit_offset``): ``(x_fp32 * rsqrt(...) * (1 + w_fp32)).to(dtype)``,
with the weight stored as an offset from 1 (initialised to zero).
"""

from __future__ import annotations

import torch

from miles_host.kernels.eager_ops import rms_norm_eager


class RMSNorm(torch.nn.Module):
    """Root-mean-square norm over the last dim."""

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = torch.nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_eager(x, self.weight, self.eps, self.unit_offset)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, unit_offset={self.unit_offset}"
