"""One-launch dequantization of a ``halves`` weight (rows or tiles) for prefill (Triton).

Above the small-M kernels' 64 token rows, an INT4 linear multiplies by the
dequantized weight with ``F.linear`` (:func:`miles_int4.kernels.int4_mm`). In
PyTorch that dequantization is ~10 elementwise launches per linear (unpack,
concatenate, convert, multiply, cast), and with tiled storage one more copy;
here it is one kernel that reads the bytes once and writes ``w_dq [N, K]``:
the QAT forward's number, ``DTYPE(fp32(q) * fp32(scale))``, via the decode
kernels' own :func:`miles_int4.decode_gemm._dequantize` (bit for bit
:func:`miles_int4.quant.dequantize`; tested under the interpreter and on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_host.kernels.triton_common import emulate_rounding
from miles_int4.decode_gemm import _dequantize, _row_offsets, weight_addressing

#: rows per program (one program: BLOCK_R rows of one group)
BLOCK_R = 64


@triton.jit
def _dequantize_halves_kernel(
    w_ptr, s_ptr, out_ptr, N, stride_tile, stride_row, stride_group, stride_sn, stride_on,
    EMULATE: tl.constexpr, BLOCK_R: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr, TILE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    group = tl.program_id(1)
    offs_h = tl.arange(0, HALF)
    mask = rows < N
    packed = tl.load(w_ptr + _row_offsets(rows, TILE, stride_tile, stride_row)[:, None] + group * stride_group
                     + offs_h[None, :], mask=mask[:, None], other=0).to(tl.int16)
    scale = tl.load(s_ptr + rows.to(tl.int64) * stride_sn + group, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    out = out_ptr + rows[:, None].to(tl.int64) * stride_on + group * GROUP + offs_h[None, :]
    tl.store(out, _dequantize(packed & 0xF, scale, dtype, EMULATE), mask=mask[:, None])
    tl.store(out + HALF, _dequantize(packed >> 4, scale, dtype, EMULATE), mask=mask[:, None])


def dequantize_halves(packed: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``w_dq [N, K]`` in ``dtype`` (bf16/fp16) of ``halves`` rows ``[N, K/2]`` or their tiles, and ``scale [N, K/gs]``."""
    weight, n, tile, *strides = weight_addressing(packed, group_size, torch.uint8, BLOCK_R)
    groups = scale.shape[1]
    out = torch.empty(n, groups * group_size, dtype=dtype, device=scale.device)
    _dequantize_halves_kernel[(triton.cdiv(n, BLOCK_R), groups)](
        weight, scale, out, n, *strides, scale.stride(0), out.stride(0),
        EMULATE=emulate_rounding(), BLOCK_R=BLOCK_R, GROUP=group_size, HALF=group_size // 2, TILE=tile, num_warps=4,
    )
    return out
