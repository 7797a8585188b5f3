"""Triton kernel of :mod:`miles_host.kernels.small_m_gemm` (needs triton)."""

from __future__ import annotations

import triton
import triton.language as tl

from miles_host.kernels._triton_common import pdl_start, pdl_wait
from miles_host.kernels.triton_common import dot, split_k_epilogue


@triton.jit
def _small_m_kernel(
    x_ptr, w_ptr, y_ptr, part_ptr, sem_ptr,
    M, N, stride_xm, stride_wn, stride_ym,
    BLOCKS_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, REDUCE_IN_KERNEL: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (n tile, K split): ``acc[BLOCK_N, BLOCK_M] = w_tile @ x_tile^T`` over its K-blocks.

    With ``PDL`` the first one or two weight blocks are loaded before the wait for the previous
    kernel (:mod:`miles_host.kernels.pdl`): the weight stream starts while that kernel finishes.
    The products are the same, in the same order, either way."""
    pdl_start(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    # N is a multiple of BLOCK_N and K of BLOCK_K (checked by the launcher): only token rows are masked
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    first = pid_k * BLOCKS_PER_SPLIT
    PREFETCH: tl.constexpr = 2 if BLOCKS_PER_SPLIT >= 2 else 1
    w0 = tl.load(w_ptrs + first * BLOCK_K)
    if PREFETCH == 2:
        w1 = tl.load(w_ptrs + (first + 1) * BLOCK_K)
    pdl_wait(PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    x = tl.load(x_ptrs + first * BLOCK_K, mask=mask_m[:, None], other=0.0)
    acc = dot(w0, tl.trans(x), acc, EMULATE)
    if PREFETCH == 2:
        x = tl.load(x_ptrs + (first + 1) * BLOCK_K, mask=mask_m[:, None], other=0.0)
        acc = dot(w1, tl.trans(x), acc, EMULATE)
    for step in range(PREFETCH, BLOCKS_PER_SPLIT):
        kb = first + step
        w = tl.load(w_ptrs + kb * BLOCK_K)
        x = tl.load(x_ptrs + kb * BLOCK_K, mask=mask_m[:, None], other=0.0)
        acc = dot(w, tl.trans(x), acc, EMULATE)
    y_offs = offs_m[None, :] * stride_ym + offs_n[:, None]
    part_offs = offs_m[None, :] * N + offs_n[:, None]
    split_k_epilogue(acc, y_ptr, part_ptr, sem_ptr, y_offs, part_offs, mask_m[None, :], pid_n, pid_k, M * N,
                     SPLIT_K, REDUCE_IN_KERNEL, EMULATE)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, y_ptr, part_ptr, sem_ptr,
    N,
    BLOCKS_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, REDUCE_IN_KERNEL: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STRIDE_WN: tl.constexpr, PDL: tl.constexpr = False,
):
    """One token (``M = 1``) on the CUDA cores, program (n tile, K split): fp32 products of a
    ``[BLOCK_N, BLOCK_K]`` weight tile and the activation chunk accumulated elementwise over the
    program's K-blocks (loads unrolled, no shared memory), then one sum per output row. With
    ``PDL`` the first weight block is loaded before the wait for the previous kernel."""
    pdl_start(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * STRIDE_WN + offs_k[None, :]
    # the activation read in the weight tile's layout (every row the same chunk, from L1): no
    # layout conversion through shared memory, so nothing orders one block's loads after another's
    x_ptrs = x_ptr + (offs_n * 0)[:, None] + offs_k[None, :]
    first = pid_k * BLOCKS_PER_SPLIT
    w = tl.load(w_ptrs + first * BLOCK_K)
    pdl_wait(PDL)
    acc = w.to(tl.float32) * tl.load(x_ptrs + first * BLOCK_K).to(tl.float32)
    for step in tl.static_range(1, BLOCKS_PER_SPLIT):
        kb = first + step
        w = tl.load(w_ptrs + kb * BLOCK_K)
        acc += w.to(tl.float32) * tl.load(x_ptrs + kb * BLOCK_K).to(tl.float32)
    total = tl.sum(acc, axis=1)
    split_k_epilogue(total, y_ptr, part_ptr, sem_ptr, offs_n, offs_n, offs_n < N, pid_n, pid_k, N,
                     SPLIT_K, REDUCE_IN_KERNEL, EMULATE)
