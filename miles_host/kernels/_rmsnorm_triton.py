"""Triton body of :mod:`miles_host.kernels.rmsnorm` (imported only on CUDA)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_host.kernels import pdl
from miles_host.kernels._triton_common import TL_DTYPES, cast, pdl_start, pdl_wait, round_to


@triton.jit
def _rmsnorm_kernel(
    X, R, W, Out, ResOut,
    stride_x, stride_r, stride_o, stride_ro,
    H, eps,
    HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        xf = round_to(r.to(tl.float32) + x.to(tl.float32), DTYPE)
        tl.store(ResOut + row * stride_ro + cols, cast(xf, DTYPE), mask=mask)
    else:
        xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    if UNIT_OFFSET:
        y = xf * rstd * (1.0 + w)
    else:
        y = round_to(xf * rstd, DTYPE) * w
    tl.store(Out + row * stride_o + cols, cast(y, DTYPE), mask=mask)


def rmsnorm(x_TH, weight_H, eps, unit_offset, residual_TH=None):
    num_rows, hidden = x_TH.shape
    out = torch.empty((num_rows, hidden), dtype=x_TH.dtype, device=x_TH.device)
    res_out = torch.empty_like(out) if residual_TH is not None else None
    if num_rows:
        residual = residual_TH if residual_TH is not None else x_TH
        _rmsnorm_kernel[(num_rows,)](
            x_TH, residual, weight_H, out, res_out if res_out is not None else out,
            x_TH.stride(0), residual.stride(0), out.stride(0), out.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual_TH is not None, UNIT_OFFSET=unit_offset,
            BLOCK=triton.next_power_of_2(hidden), DTYPE=TL_DTYPES[x_TH.dtype], num_warps=4 if hidden <= 2048 else 8,
            **pdl.options(x_TH),
        )
    return out, res_out
