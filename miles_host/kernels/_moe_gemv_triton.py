"""Triton body of :mod:`miles_host.kernels.moe_gemv` (imported only where Triton runs)."""

from __future__ import annotations

import triton
import triton.language as tl

from miles_host.kernels._moe_grouped_triton import ACTIVATIONS, act_and_mul
from miles_host.kernels._split_k_triton import cast_rne, emulate_rounding


@triton.jit
def _row_tile(w_ptrs, offs_k, k0, K: tl.constexpr):
    """``[BLOCK_N, BLOCK_K]`` of the weight rows at ``w_ptrs``, columns ``k0 ..``, in fp32 (0 past K)."""
    return tl.load(w_ptrs + k0, mask=(k0 + offs_k < K)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _moe_gemv_kernel(
    A, RowToken, PairRow, BlockExpert, W, C,
    N, stride_am, stride_we, stride_wn, stride_cm,
    K: tl.constexpr, ROW_BLOCK: tl.constexpr, GATHER: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
    EMULATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program ``(n, p)``: ``BLOCK_N`` columns of pair ``p``'s padded row (module doc of :mod:`miles_host.kernels.moe_gemv`)."""
    pid_n = tl.program_id(0)
    row = tl.load(PairRow + tl.program_id(1))
    expert = tl.load(BlockExpert + row // ROW_BLOCK).to(tl.int64)
    a_row = tl.load(RowToken + row) if GATHER else row
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    cols = tl.where(mask_n, offs_n, 0).to(tl.int64)
    x_ptrs = A + a_row * stride_am + offs_k
    w_ptrs = W + expert * stride_we + cols[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    w = _row_tile(w_ptrs, offs_k, 0, K)
    if GATED:
        w_up = _row_tile(w_ptrs + N * stride_wn, offs_k, 0, K)
    for k0 in range(0, K, BLOCK_K):
        # the next tile is requested before this one's products (a GEMV waits on HBM otherwise)
        following = tl.minimum(k0 + BLOCK_K, ((K - 1) // BLOCK_K) * BLOCK_K)
        next_w = _row_tile(w_ptrs, offs_k, following, K)
        x = tl.load(x_ptrs + k0, mask=k0 + offs_k < K, other=0.0).to(tl.float32)[None, :]
        acc += w * x  # bf16 x bf16 products are exact in fp32
        w = next_w
        if GATED:
            next_up = _row_tile(w_ptrs + N * stride_wn, offs_k, following, K)
            acc_up += w_up * x
            w_up = next_up
    if GATED:
        out = act_and_mul(tl.sum(acc, axis=1), tl.sum(acc_up, axis=1), ACT, C.dtype.element_ty, EMULATE)
    else:
        out = cast_rne(tl.sum(acc, axis=1), C.dtype.element_ty, EMULATE)
    tl.store(C + row * stride_cm + offs_n, out, mask=mask_n)


def moe_gemv(a, pair_row_TK, row_token_R, block_expert_B, block_m: int, w_ENK, out_RN, gather: bool,
             activation: str | None, block_n: int, block_k: int, num_warps: int) -> None:
    """``out[r] = a[row r] @ w_ENK[expert of r]^T`` for the pair rows (``activation``: gate_up, ``w_ENK`` is
    ``[E, 2N, K]`` gate rows first and ``out[r] = act(gate) * up``)."""
    n, k = out_RN.shape[1], w_ENK.shape[2]
    pairs = pair_row_TK.numel()
    if pairs == 0 or n == 0:
        return
    assert a.stride(1) == 1 and w_ENK.stride(2) == 1 and out_RN.stride(1) == 1 and pair_row_TK.is_contiguous()
    _moe_gemv_kernel[(triton.cdiv(n, block_n), pairs)](
        a, row_token_R, pair_row_TK, block_expert_B, w_ENK, out_RN,
        n, a.stride(0), w_ENK.stride(0), w_ENK.stride(1), out_RN.stride(0),
        K=k, ROW_BLOCK=block_m, GATHER=gather, GATED=activation is not None,
        ACT=ACTIVATIONS[activation] if activation is not None else 0, EMULATE=emulate_rounding(),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )

