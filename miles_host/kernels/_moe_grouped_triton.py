"""Triton body of :mod:`miles_host.kernels.moe_grouped` (imported only where Triton runs).

One grouped GEMM launch for all experts. The rows are the padded layout of
:func:`~miles_host.kernels.moe_grouped.route`: every expert's rows start at a
multiple of ``BLOCK_M``, so each ``BLOCK_M`` row block belongs to one expert
(``block_expert[block]``, -1 for the blocks past the used ones: their programs
do nothing). A program computes one row block x one ``BLOCK_N`` column tile:
``out[rows, n] = a[rows, :] @ w[expert][:, n]`` with fp32 accumulation from
``k = 0`` in ``BLOCK_K`` chunks, one round-to-nearest-even to the output dtype.
With ``GATHER`` the rows of ``a`` are read through the row -> token table (the
first GEMM reads ``x`` directly, no gathered copy); padding rows (token -1) read
zeros. The weight ``w[expert]`` is read as ``[K, N]`` through its strides (the
``[E, N, K]`` stacks of ``Experts`` need no copy).

Under the interpreter (``EMULATE``) ``tl.dot`` runs on float32 copies (its
``np.matmul`` reads bfloat16 as raw integers) and the downcast rounds by integer
arithmetic (``cast_rne``). ``K`` is a constexpr (a model constant: H or I), so the
K loop has a static, host-computed trip count on both paths (numpy 2.4
cannot take ``range`` of the interpreter's runtime scalars).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_host.kernels._split_k_triton import cast_rne, emulate_rounding


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr, EMULATE: tl.constexpr):
    """``acc + a @ b`` in fp32 (float32 inputs: ``ieee``, never TF32)."""
    if EMULATE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _grouped_mm_kernel(
    A, RowToken, BlockExpert, W, C,
    N,
    stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_cm, stride_cn,
    K: tl.constexpr, K_BLOCKS: tl.constexpr, GATHER: tl.constexpr, IEEE: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(BlockExpert + pid_m)
    if expert >= 0:
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        if GATHER:
            token = tl.load(RowToken + offs_m)
            row_ok = token >= 0
            rows = tl.where(row_ok, token, 0).to(tl.int64)
        else:
            row_ok = offs_m >= 0
            rows = offs_m
        cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        a_ptrs = A + rows[:, None] * stride_am + offs_k[None, :].to(tl.int64) * stride_ak
        w_ptrs = W + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + offs_k[:, None].to(tl.int64) * stride_wk

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, K_BLOCKS):
            k_ok = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            acc = _mma(a, w, acc, IEEE, EMULATE)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk

        c_ptrs = C + offs_m[:, None] * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn
        tl.store(c_ptrs, cast_rne(acc, C.dtype.element_ty, EMULATE), mask=(offs_n < N)[None, :])


def grouped_mm(a, row_token_R, block_expert_B, w_EKN, out_RN, config, gather: bool) -> torch.Tensor:
    """``out[r] = a[row r] @ w_EKN[expert of r's block]`` for every row of a used block.

    ``a``: ``[T, K]`` (``gather``: row r reads ``a[row_token_R[r]]``) or ``[R, K]``;
    ``w_EKN``: any-strided ``[E, K, N]`` view; ``out_RN``: ``[R, N]`` with
    ``R = len(block_expert_B) * block_m`` (rows of unused blocks are left as they are).
    """
    n, k = out_RN.shape[1], w_EKN.shape[1]
    num_blocks = block_expert_B.shape[0]
    if num_blocks == 0 or n == 0:
        return out_RN
    grid = (num_blocks, triton.cdiv(n, config.block_n))
    _grouped_mm_kernel[grid](
        a, row_token_R, block_expert_B, w_EKN, out_RN,
        n,
        a.stride(0), a.stride(1), w_EKN.stride(0), w_EKN.stride(1), w_EKN.stride(2),
        out_RN.stride(0), out_RN.stride(1),
        K=k, K_BLOCKS=triton.cdiv(k, config.block_k), GATHER=gather, IEEE=a.dtype == torch.float32, EMULATE=emulate_rounding(),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out_RN
