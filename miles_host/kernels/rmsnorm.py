"""RMSNorm with an optional fused residual add: one kernel per norm.

``rmsnorm(x, weight, eps, unit_offset, residual)`` returns ``(norm(s), s)``
with ``s = residual + x`` rounded to the activation dtype (``s = x`` and no
second output when ``residual`` is None): the residual stream of a pre-norm
decoder, one kernel instead of the eager add + eight norm kernels.
Reference: :func:`rmsnorm_reference` (:func:`miles_host.kernels.eager_ops.rms_norm_eager`, the eager RMSNorm math).
Tensor legend: T rows (tokens), H hidden.
"""

from __future__ import annotations

import torch

from miles_host.kernels.eager_ops import rms_norm_eager


def rmsnorm_reference(
    x_TH: torch.Tensor, weight_H: torch.Tensor, eps: float, unit_offset: bool, residual_TH: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain PyTorch: the eager residual add, then the eager norm."""
    if residual_TH is not None:
        x_TH = residual_TH + x_TH
    return rms_norm_eager(x_TH, weight_H, eps, unit_offset), (x_TH if residual_TH is not None else None)


def rmsnorm(
    x_TH: torch.Tensor, weight_H: torch.Tensor, eps: float, unit_offset: bool, residual_TH: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused on CUDA when the weight has the activation dtype; the reference otherwise.
    Differentiable (the reference's gradient, :mod:`~miles_host.kernels.eager_backward`)."""
    if not x_TH.is_cuda or weight_H.dtype != x_TH.dtype or x_TH.stride(-1) != 1 or x_TH.dim() != 2:
        return rmsnorm_reference(x_TH, weight_H, eps, unit_offset, residual_TH)
    from miles_host.kernels.eager_backward import fused_with_eager_backward

    return fused_with_eager_backward(
        _fused, _reference, x_TH, weight_H, residual_TH, eps=eps, unit_offset=unit_offset
    )


def _fused(x_TH, weight_H, residual_TH, *, eps, unit_offset):
    from miles_host.kernels import _rmsnorm_triton

    return _rmsnorm_triton.rmsnorm(x_TH, weight_H, eps, unit_offset, residual_TH)


def _reference(x_TH, weight_H, residual_TH, *, eps, unit_offset):
    return rmsnorm_reference(x_TH, weight_H, eps, unit_offset, residual_TH)
