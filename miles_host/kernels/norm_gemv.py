"""A decode layer's residual add and RMSNorm inside the one-token GEMV that reads the norm's
output: :func:`norm_gemv`.

At batch 1 each of a decoder layer's two norms is a launch of its own (~2 us on an H100 with
the gap after it) whose reader is a one-token CUDA-core GEMV
(:func:`~miles_host.kernels._small_m_gemm_triton._gemv_kernel`): the qkv projection reads the
input norm, the router the post-attention norm. Every program of such a GEMV reads the whole
activation row anyway, so it can as well read ``h`` and the residual, sum the row's squares
(a few KB from L2) and normalize each chunk as it multiplies it
(:func:`~miles_host.kernels._small_m_gemm_triton._norm_gemv_kernel`); program ``(0, 0)``
stores the new residual, and the normalized row where another kernel reads it too (the
experts after the router). Two launches per layer fewer; the products are the GEMV's, the
normalized activations the RMSNorm kernel's up to the order of the sum of squares.

:class:`PendingNorm` is the norm not yet computed. :func:`normed_linear` (the qkv projection)
and :meth:`~miles_host.models.mlp.MoE.forward_pending` (the router) run the fused kernel
where :func:`takes`: the small-M table gives the shape a GEMV launch (one token, CUDA, 16-bit,
no autograd, ``--small-m-gemm triton``, ``--decode-norms fused``); else the norm
(:func:`~miles_host.kernels.rmsnorm.rmsnorm`) and the linear. The reference is those two.

Tensor legend: T tokens, H hidden (K), N out features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_host.kernels import pdl, split_k, small_m_gemm, switches
from miles_host.kernels.rmsnorm import rmsnorm

#: ``--decode-norms``: ``fused`` (the norms fuse where :func:`takes`) or ``separate``
DECODE_NORMS = switches.declare_host("decode_norms")
#: longest row the fused kernel normalizes (held in registers by every program)
MAX_K = 8192


@dataclass(frozen=True)
class PendingNorm:
    """``rmsnorm(residual + h)`` (``h`` alone before the first layer) not yet computed."""

    h_TH: torch.Tensor
    residual_TH: torch.Tensor | None
    weight_H: torch.Tensor
    eps: float
    unit_offset: bool

    @classmethod
    def of(cls, norm: torch.nn.Module, h_TH: torch.Tensor, residual_TH: torch.Tensor | None) -> "PendingNorm":
        """The pending output of an :class:`~miles_host.models.layers.RMSNorm` module."""
        return cls(h_TH, residual_TH, norm.weight, norm.eps, norm.unit_offset)

    def apply(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normalized rows, the new residual)`` by the RMSNorm kernel."""
        x_TH, residual_TH = rmsnorm(self.h_TH, self.weight_H, self.eps, self.unit_offset, self.residual_TH)
        return x_TH, self.h_TH if residual_TH is None else residual_TH


def takes(pending: PendingNorm, w_NK: torch.Tensor) -> bool:
    """Whether :func:`normed_linear` fuses the norm into this weight's GEMV."""
    h_TH = pending.h_TH
    if switches.value(DECODE_NORMS) != "fused" or h_TH.dim() != 2 or h_TH.shape[0] != 1 or not small_m_gemm.takes(h_TH, w_NK):
        return False
    n, k = w_NK.shape
    launch = small_m_gemm.launch_for(1, n, k)
    return (launch.kernel == "gemv" and launch.tiles(n, k) and k <= MAX_K and h_TH.stride(-1) == 1
            and pending.weight_H.dtype == h_TH.dtype and pending.weight_H.is_contiguous()
            and (pending.residual_TH is None or pending.residual_TH.stride(-1) == 1))


def norm_gemv(pending: PendingNorm, w_NK: torch.Tensor, write_x: bool = False,
              launch: small_m_gemm.Launch | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(rmsnorm(residual + h) @ w^T [1, N], the new residual [1, K], the normalized row [1, K]
    with write_x else None)`` in one launch (see the module doc). CUDA tensors, or CPU ones under
    ``TRITON_INTERPRET=1``."""
    import triton

    from miles_host.kernels._small_m_gemm_triton import _norm_gemv_kernel
    from miles_host.kernels._triton_common import TL_DTYPES
    from miles_host.kernels.triton_common import emulate_rounding

    h_TH, residual_TH = pending.h_TH, pending.residual_TH
    n, k = w_NK.shape
    launch = launch or small_m_gemm.launch_for(1, n, k)
    out = torch.empty((1, n), dtype=h_TH.dtype, device=h_TH.device)
    residual_out = torch.empty_like(h_TH) if residual_TH is not None else h_TH
    x_out = torch.empty_like(h_TH) if write_x else None
    plan = split_k.fixed_split(n // launch.block_n, k // launch.block_k, launch.split or 1)
    partials, counters, in_kernel = split_k.workspace(plan, 1, n, h_TH.device, out)
    _norm_gemv_kernel[(plan.n_tiles, plan.split_k)](
        h_TH, residual_TH if residual_TH is not None else h_TH, pending.weight_H, w_NK, out, residual_out,
        x_out if x_out is not None else out, partials, counters, n, k, float(pending.eps),
        BLOCKS_PER_SPLIT=plan.blocks_per_split, SPLIT_K=plan.split_k, REDUCE_IN_KERNEL=in_kernel,
        EMULATE=emulate_rounding(), BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, STRIDE_WN=w_NK.stride(0),
        K_PAD=triton.next_power_of_2(k), HAS_RESIDUAL=residual_TH is not None, UNIT_OFFSET=pending.unit_offset,
        WRITE_X=write_x, DTYPE=TL_DTYPES[h_TH.dtype], num_warps=launch.num_warps, num_stages=launch.num_stages,
        **pdl.options(h_TH),
    )
    if not in_kernel:
        out.copy_(partials.sum(dim=0))
    return out, residual_out, x_out


def normed_linear(module: torch.nn.Module, pending: PendingNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """``(module(rmsnorm(residual + h)), the new residual)``: one launch where :func:`takes`, else the
    norm then :func:`~miles_host.kernels.small_m_gemm.decode_linear`."""
    if type(module) is torch.nn.Linear and takes(pending, module.weight):
        y_TN, residual_TH, _ = norm_gemv(pending, module.weight)
        return (y_TN if module.bias is None else y_TN + module.bias), residual_TH
    x_TH, residual_TH = pending.apply()
    return small_m_gemm.decode_linear(module, x_TH), residual_TH


__all__ = ["DECODE_NORMS", "MAX_K", "PendingNorm", "norm_gemv", "normed_linear", "takes"]
