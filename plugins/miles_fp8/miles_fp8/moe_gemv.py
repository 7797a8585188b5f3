"""One-token FP8 experts: a CUDA-core grouped GEMV over the E4M3 stacks.

At batch-1 decode every routed expert multiplies one row. The grouped block-scaled kernel
(:mod:`miles_fp8.moe_fused`) pads that row to a 16-row MMA block; this kernel gives each
(token, slot) pair's row its own programs and multiplies on CUDA cores. The numbers are the
tensor-core kernel's up to the order of the fp32 sums: per 128-deep K block the row is
quantized in the kernel as training quantizes activations
(:func:`miles_fp8.triton_kernels._quantize_rows`, 1x128 groups), each E4M3 weight times its
E4M3 activation is exact in fp32, the block's sum is scaled by the two scales and added in fp32;
gate_up computes gate and up columns together and ends in the same ``act(gate) * up`` rounding.

Grid ``(N / BLOCK_N, T * top_k)``: program ``(n, p)`` reads pair ``p``'s padded row ``r``
(``pair_row_TK``), its expert (``block_expert_B[r // block_m]``) and input row (the token with
``GATHER``, else ``r``) and writes ``BLOCK_N`` columns of row ``r`` (``BLOCK_N`` divides 128:
one weight scale per K block). Padding rows are neither read nor written. ``--fp8-moe-gemv-tokens N``
sets the most tokens that take it (default 0: every batch on the tensor-core kernel). Reference: the per-expert loop
(``moe_kernel = "loop"``) and :func:`miles_fp8.moe_fused.fp8_moe_gemm`.

Tensor legend: R padded rows, N output columns, K input columns (both multiples of 128).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_host.kernels import switches
from miles_host.kernels.moe_grouped import Routing
from miles_host.kernels.triton_common import ACTIVATIONS, act_and_mul, cast_rne, emulate_rounding
from miles_fp8 import kernel_switches
from miles_fp8.quant import BLOCK
from miles_fp8.triton_kernels import _quantize_rows

#: output columns per program by projection: narrow gate_up tiles (each reads gate and up rows)
#: spread the few experts' bytes over more programs than SMs
GATE_UP_BLOCK_N = 32
DOWN_BLOCK_N = 64
GEMV_WARPS = 4


@triton.jit
def _block_dot(x, w, POW2: tl.constexpr, EMULATE: tl.constexpr):
    """``[BLOCK_N]`` unscaled sums of ``Q(x) * w`` over one K block, and x's scale ``[1]``."""
    q, x_scale = _quantize_rows(x, POW2, EMULATE)
    return tl.sum(w.to(tl.float32) * q.to(tl.float32), axis=1), x_scale


@triton.jit
def _fp8_moe_gemv_kernel(
    A, RowToken, PairRow, BlockExpert, W, WS, C,
    N, stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_cm,
    K_BLOCKS: tl.constexpr, ROW_BLOCK: tl.constexpr, GATHER: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
    POW2: tl.constexpr, EMULATE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    row = tl.load(PairRow + tl.program_id(1))
    expert = tl.load(BlockExpert + row // ROW_BLOCK).to(tl.int64)
    a_row = tl.load(RowToken + row) if GATHER else row
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, 128).to(tl.int64)
    x_ptrs = A + a_row * stride_am + offs_k[None, :]
    w_ptrs = W + expert * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
    ws_ptr = WS + expert * stride_wse + (pid_n * BLOCK_N // 128) * stride_wsn
    ws_up_ptr = WS + expert * stride_wse + ((pid_n * BLOCK_N + N) // 128) * stride_wsn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    w = tl.load(w_ptrs)
    if GATED:
        w_up = tl.load(w_ptrs + N * stride_wn)
    for kb in range(0, K_BLOCKS):
        # the next block's weights are requested before this block's arithmetic
        following = tl.minimum(kb + 1, K_BLOCKS - 1) * 128
        next_w = tl.load(w_ptrs + following)
        x = tl.load(x_ptrs + kb * 128).to(tl.float32)
        block, x_scale = _block_dot(x, w, POW2, EMULATE)
        acc += block * (x_scale * tl.load(ws_ptr + kb))
        w = next_w
        if GATED:
            next_up = tl.load(w_ptrs + N * stride_wn + following)
            block_up, _ = _block_dot(x, w_up, POW2, EMULATE)
            acc_up += block_up * (x_scale * tl.load(ws_up_ptr + kb))
            w_up = next_up
    if GATED:
        out = act_and_mul(acc, acc_up, ACT, C.dtype.element_ty, EMULATE)
    else:
        out = cast_rne(acc, C.dtype.element_ty, EMULATE)
    tl.store(C + row * stride_cm + offs_n, out)


def takes_gemv(routing: Routing) -> bool:
    """At most ``--fp8-moe-gemv-tokens`` tokens (default 0, none, until a GPU measurement sets it; a function
    of the token count, so a captured decode graph always replays the same kernel)."""
    return 0 < routing.pair_row_TK.shape[0] <= switches.value(kernel_switches.MOE_GEMV_TOKENS)


def fp8_moe_gemv(a: torch.Tensor, routing: Routing, w_q: torch.Tensor, w_scale: torch.Tensor, out_RN: torch.Tensor,
                 gather: bool, activation: str | None, power_of_two: bool) -> None:
    """``out[r] = Q_1x128(a[row r]) @ (w_q * w_scale)[expert of r]^T`` for the pair rows of ``routing``;
    arguments as :func:`miles_fp8.moe_fused.fp8_moe_gemm`'s."""
    n, k = out_RN.shape[1], w_q.shape[2]
    pairs = routing.pair_row_TK.numel()
    if pairs == 0:
        return
    block_n = min(GATE_UP_BLOCK_N if activation is not None else DOWN_BLOCK_N, BLOCK)
    while n % block_n:
        block_n //= 2
    assert a.stride(1) == 1 and w_q.stride(2) == 1 and out_RN.stride(1) == 1 and w_scale.stride(2) == 1
    assert routing.pair_row_TK.is_contiguous()
    _fp8_moe_gemv_kernel[(n // block_n, pairs)](
        a, routing.row_token_R, routing.pair_row_TK, routing.block_expert_B, w_q, w_scale, out_RN,
        n, a.stride(0), w_q.stride(0), w_q.stride(1), w_scale.stride(0), w_scale.stride(1), out_RN.stride(0),
        K_BLOCKS=k // BLOCK, ROW_BLOCK=routing.block_m, GATHER=gather, GATED=activation is not None,
        ACT=ACTIVATIONS[activation] if activation is not None else 0, POW2=power_of_two,
        EMULATE=emulate_rounding(), BLOCK_N=block_n, num_warps=GEMV_WARPS,
    )
