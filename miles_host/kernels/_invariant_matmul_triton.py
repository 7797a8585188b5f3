"""Triton body of :mod:`miles_host.kernels.invariant_matmul` (imported only where Triton runs).

One program per ``[block_m, block_n]`` output tile (grouped launch order for L2
reuse of ``b``; :func:`bmm`: per tile and batch entry, each entry's tiles computed as
:func:`mm` computes them). Each program walks K from 0 in ``BLOCK_K`` chunks, masks the K
tail with zeros (zero products leave the sums unchanged) and accumulates with
``tl.dot`` into one fp32 accumulator: the same sums, in the same order, for an
output element whatever tile it sits in. Rows and columns past the edge load
row / column 0 and are never stored. Offsets are int64 (a ``[16k, 151936]``
logits output passes 2^31 elements).

Under the interpreter (``EMULATE``) the products are summed elementwise
(:func:`_emulated_k_step`), the downcast rounds by integer arithmetic
(``cast_rne``; on the GPU one ``cvt.rn``), and the K loop runs a host-computed
trip count: numpy 2.4 cannot take ``range`` of the interpreter's runtime
scalars. On the GPU K stays a runtime argument (the backward's weight gradient
reduces over the token count, new every step: no recompiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_host.kernels._split_k_triton import cast_rne, emulate_rounding
from miles_host.kernels._triton_common import grouped_tile


@triton.jit
def _k_step(acc, a_ptrs, b_ptrs, kb, K, offs_k, stride_ak, stride_bk,
            EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc + a[:, kb-th K block] @ b[kb-th K block, :]`` (the K tail masked to zeros)."""
    k0 = (kb * BLOCK_K).to(tl.int64)  # int64: lm-head gradients step over 151936-element strides
    step_a = a_ptrs + k0 * stride_ak
    step_b = b_ptrs + k0 * stride_bk
    if EVEN_K:
        a = tl.load(step_a)
        b = tl.load(step_b)
    else:
        k_mask = offs_k < K - kb * BLOCK_K
        a = tl.load(step_a, mask=k_mask[None, :], other=0.0)
        b = tl.load(step_b, mask=k_mask[:, None], other=0.0)
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _emulated_k_step(acc, a_rows, b_cols, kb, K, stride_ak, stride_bk, BLOCK_K: tl.constexpr):
    """The interpreter's :func:`_k_step`: fp32 products summed over 16-deep slices of the block.

    Not ``tl.dot``: the interpreter's ``np.matmul`` reads bf16 as raw integers and,
    for float32, its BLAS rounds an element differently by its place in the tile.
    Here every element sees the same operations wherever it sits.
    """
    sub = tl.arange(0, 16)
    for j in tl.static_range(BLOCK_K // 16):
        k = (kb * BLOCK_K + j * 16 + sub).to(tl.int64)
        a = tl.load(a_rows + k[None, :] * stride_ak, mask=k[None, :] < K, other=0.0).to(tl.float32)
        b = tl.load(b_cols + k[:, None] * stride_bk, mask=k[:, None] < K, other=0.0).to(tl.float32)
        acc += tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    return acc


@triton.jit
def _mm_tile(
    A, B, Bias, C, tile,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, EMULATE: tl.constexpr, EMULATED_K_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Output tile ``tile`` (in the grouped launch order) of ``C = A @ B (+ Bias)``."""
    pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    a_rows = A + rows[:, None] * stride_am
    b_cols = B + cols[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if EMULATE:
        for kb in range(0, EMULATED_K_BLOCKS):
            acc = _emulated_k_step(acc, a_rows, b_cols, kb, K, stride_ak, stride_bk, BLOCK_K)
    else:
        a_ptrs = a_rows + offs_k[None, :].to(tl.int64) * stride_ak
        b_ptrs = b_cols + offs_k[:, None].to(tl.int64) * stride_bk
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            acc = _k_step(acc, a_ptrs, b_ptrs, kb, K, offs_k, stride_ak, stride_bk, EVEN_K, BLOCK_K)

    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = C + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, cast_rne(acc, C.dtype.element_ty, EMULATE), mask=mask)


@triton.jit
def _invariant_mm_kernel(
    A, B, Bias, C,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, EMULATE: tl.constexpr, EMULATED_K_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    _mm_tile(A, B, Bias, C, tl.program_id(0), M, N, K,
             stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
             HAS_BIAS, EVEN_K, EMULATE, EMULATED_K_BLOCKS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)


@triton.jit
def _invariant_bmm_kernel(
    A, B, C,
    M, N, K,
    stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn, stride_cb, stride_cm, stride_cn,
    EVEN_K: tl.constexpr, EMULATE: tl.constexpr, EMULATED_K_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Program ``(tile, batch)``: :func:`_invariant_mm_kernel`'s tile of batch entry ``batch``."""
    batch = tl.program_id(1).to(tl.int64)
    _mm_tile(A + batch * stride_ab, B + batch * stride_bb, C, C + batch * stride_cb, tl.program_id(0), M, N, K,
             stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
             False, EVEN_K, EMULATE, EMULATED_K_BLOCKS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)


def mm(a_MK: torch.Tensor, b_KN: torch.Tensor, bias_N: torch.Tensor | None, config, out_dtype: torch.dtype):
    """Launch one invariant GEMM (shapes and dtypes checked by the caller)."""
    m, k = a_MK.shape
    n = b_KN.shape[1]
    out_MN = torch.empty((m, n), dtype=out_dtype, device=a_MK.device)
    if m == 0 or n == 0:
        return out_MN
    emulate = emulate_rounding()
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    _invariant_mm_kernel[grid](
        a_MK, b_KN, bias_N if bias_N is not None else out_MN, out_MN,
        m, n, k,
        a_MK.stride(0), a_MK.stride(1), b_KN.stride(0), b_KN.stride(1), out_MN.stride(0), out_MN.stride(1),
        HAS_BIAS=bias_N is not None, EVEN_K=k % config.block_k == 0,
        EMULATE=emulate, EMULATED_K_BLOCKS=triton.cdiv(k, config.block_k) if emulate else 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out_MN


def bmm(a_BMK: torch.Tensor, b_BKN: torch.Tensor, config, out_dtype: torch.dtype) -> torch.Tensor:
    """Launch one invariant GEMM per batch entry, all in one grid (shapes checked by the caller)."""
    batches, m, k = a_BMK.shape
    n = b_BKN.shape[2]
    out_BMN = torch.empty((batches, m, n), dtype=out_dtype, device=a_BMK.device)
    if batches == 0 or m == 0 or n == 0:
        return out_BMN
    emulate = emulate_rounding()
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), batches)
    _invariant_bmm_kernel[grid](
        a_BMK, b_BKN, out_BMN,
        m, n, k,
        a_BMK.stride(0), a_BMK.stride(1), a_BMK.stride(2), b_BKN.stride(0), b_BKN.stride(1), b_BKN.stride(2),
        out_BMN.stride(0), out_BMN.stride(1), out_BMN.stride(2),
        EVEN_K=k % config.block_k == 0,
        EMULATE=emulate, EMULATED_K_BLOCKS=triton.cdiv(k, config.block_k) if emulate else 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out_BMN
