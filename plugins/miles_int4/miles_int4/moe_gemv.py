"""One-token INT4 experts: a CUDA-core grouped GEMV over the compressed-tensors words.

At batch-1 decode every routed expert multiplies one row. The grouped tensor-core kernel
(:mod:`miles_int4.moe_fused`) pads that row to a 16-row MMA block and dequantizes each tile
through shared memory; this kernel instead gives each (token, slot) pair's row its own
programs and multiplies on CUDA cores, as :mod:`miles_int4.decode_gemm`'s dense GEMV does
for the linears: the same per-word arithmetic (:func:`~miles_int4.decode_gemm._word_dot`:
``lop3`` into the bf16 ``128 + nibble``, ``sub`` / ``mul.bf16x2`` by the scale, fp32 FMAs),
so the weights are the QAT forward's bf16 numbers and the products exact, with fp32 sums.

Layout read: compressed-tensors' ``packed [E, N, K/8]`` int32 (column ``8w + i`` of a row in
bits ``4i .. 4i+3`` of word ``w``, stored as ``q + 8``) and ``scale [E, N, K/G]``, as weight
sync sends them (no second copy of the experts). A word's nibble pairs ``(i, i + 4)`` sit in
its two 16-bit halves, so the word-dot's input ``j`` is column ``8w + j // 2 + 4 (j % 2)``.

Grid ``(cdiv(N, BLOCK_N), T * top_k)``: program ``(n, p)`` reads pair ``p``'s padded row ``r``
(``pair_row_TK``), its expert (``block_expert_B[r // block_m]``) and input row (the token with
``GATHER``, else ``r``), and writes ``BLOCK_N`` columns of row ``r``; gate_up computes gate and
up columns together and ends in the same ``act(gate) * up`` rounding as the tensor-core
kernel's epilogue. Padding rows are neither read nor written (the combine reads pair rows
only). ``--int4-moe-gemv-tokens N`` sets the most tokens that take it (default 1; 0 turns it
off). Reference: the per-expert loop over the dequantized weights (``Int4Experts`` with
``moe_kernel = "loop"``) and the grouped kernel (tests).

Tensor legend: R padded rows, N output columns, K input columns, G groups, W words per group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_host.kernels import switches
from miles_host.kernels.moe_grouped import Routing
from miles_host.kernels.triton_common import ACTIVATIONS, act_and_mul, cast_rne, emulate_rounding
from miles_int4 import kernel_switches
from miles_int4.decode_gemm import _scaled_word_dot
from miles_int4.quant import PACK_FACTOR

#: output columns per program by projection: narrow gate_up tiles (each reads gate and up rows)
#: spread the few experts' bytes over more programs than SMs
GATE_UP_BLOCK_N = 32
DOWN_BLOCK_N = 64
GEMV_WARPS = 4


@triton.jit
def _x_word_input(x_row_ptr, base, offs_w, J: tl.constexpr):
    """fp32 activations ``[1, W]``: input ``J`` of the word-dot of every word of the group at ``base``."""
    return tl.load(x_row_ptr + base + 8 * offs_w + (J // 2 + 4 * (J % 2))).to(tl.float32)[None, :]


@triton.jit
def _group_words(w_ptrs, s_ptrs, mask_n, group, WORDS: tl.constexpr):
    """Group ``group``'s words ``[BLOCK_N, W]`` and bf16 scales ``[BLOCK_N]`` of the rows at ``w_ptrs`` / ``s_ptrs``."""
    return (tl.load(w_ptrs + group * WORDS, mask=mask_n[:, None], other=0),
            tl.load(s_ptrs + group, mask=mask_n, other=0.0))


@triton.jit
def _group_dot(words, scale, x_row_ptr, base, offs_w, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 ``[BLOCK_N, W]`` lanes: each word's eight weights times their activations (the compressed-tensors
    column order of :func:`_x_word_input`)."""
    x0 = _x_word_input(x_row_ptr, base, offs_w, 0)
    x1 = _x_word_input(x_row_ptr, base, offs_w, 1)
    x2 = _x_word_input(x_row_ptr, base, offs_w, 2)
    x3 = _x_word_input(x_row_ptr, base, offs_w, 3)
    x4 = _x_word_input(x_row_ptr, base, offs_w, 4)
    x5 = _x_word_input(x_row_ptr, base, offs_w, 5)
    x6 = _x_word_input(x_row_ptr, base, offs_w, 6)
    x7 = _x_word_input(x_row_ptr, base, offs_w, 7)
    return _scaled_word_dot(words, scale, x0, x1, x2, x3, x4, x5, x6, x7, DTYPE, EMULATE)


@triton.jit
def _int4_moe_gemv_kernel(
    A, RowToken, PairRow, BlockExpert, W, S, C,
    N, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm,
    GROUPS: tl.constexpr, GROUP: tl.constexpr, ROW_BLOCK: tl.constexpr, GATHER: tl.constexpr,
    GATED: tl.constexpr, ACT: tl.constexpr, EMULATE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    WORDS: tl.constexpr = GROUP // 8
    pid_n = tl.program_id(0)
    row = tl.load(PairRow + tl.program_id(1))
    expert = tl.load(BlockExpert + row // ROW_BLOCK).to(tl.int64)
    a_row = tl.load(RowToken + row) if GATHER else row
    x_row_ptr = A + a_row * stride_am
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, WORDS)
    mask_n = offs_n < N
    cols = tl.where(mask_n, offs_n, 0).to(tl.int64)
    w_ptrs = W + expert * stride_we + cols[:, None] * stride_wn + offs_w[None, :]
    s_ptrs = S + expert * stride_se + cols * stride_sn
    dtype = A.dtype.element_ty
    acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    words, scale = _group_words(w_ptrs, s_ptrs, mask_n, 0, WORDS)
    if GATED:
        up_words, up_scale = _group_words(w_ptrs + N * stride_wn, s_ptrs + N * stride_sn, mask_n, 0, WORDS)
    for group in range(GROUPS):
        # the next group's words are requested before this group's arithmetic (as the dense GEMV)
        following = tl.minimum(group + 1, GROUPS - 1)
        next_words, next_scale = _group_words(w_ptrs, s_ptrs, mask_n, following, WORDS)
        acc += _group_dot(words, scale, x_row_ptr, group * GROUP, offs_w, dtype, EMULATE)
        words, scale = next_words, next_scale
        if GATED:
            next_up, next_up_scale = _group_words(w_ptrs + N * stride_wn, s_ptrs + N * stride_sn, mask_n, following,
                                                  WORDS)
            acc_up += _group_dot(up_words, up_scale, x_row_ptr, group * GROUP, offs_w, dtype, EMULATE)
            up_words, up_scale = next_up, next_up_scale
    if GATED:
        out = act_and_mul(tl.sum(acc, axis=1), tl.sum(acc_up, axis=1), ACT, C.dtype.element_ty, EMULATE)
    else:
        out = cast_rne(tl.sum(acc, axis=1), C.dtype.element_ty, EMULATE)
    tl.store(C + row * stride_cm + offs_n, out, mask=mask_n)


def takes_gemv(a: torch.Tensor, routing: Routing) -> bool:
    """bf16 / fp16 activations of at most ``--int4-moe-gemv-tokens`` tokens (default 1: batch-1 decode, where it
    is faster than the grouped kernel; at 32 tokens it is slower: ``bench/RESULTS.md``). A function of the token
    count, so a captured decode graph always replays the same kernel."""
    return (0 < routing.pair_row_TK.shape[0] <= switches.value(kernel_switches.MOE_GEMV_TOKENS)
            and a.dtype in (torch.bfloat16, torch.float16))


def int4_moe_gemv(a: torch.Tensor, routing: Routing, packed: torch.Tensor, scale: torch.Tensor, out_RN: torch.Tensor,
                  gather: bool, activation: str | None) -> None:
    """``out[r] = a[row r] @ dequantize(packed, scale)[expert of r]^T`` for the pair rows of ``routing``
    (``activation``: gate_up, ``act(gate) * up``); arguments as :func:`miles_int4.moe_fused.int4_moe_gemm`'s."""
    n = out_RN.shape[1]
    k = packed.shape[2] * PACK_FACTOR
    group = k // scale.shape[2]
    pairs = routing.pair_row_TK.numel()
    if pairs == 0 or n == 0:
        return
    assert a.stride(1) == 1 and packed.stride(2) == 1 and scale.stride(2) == 1 and out_RN.stride(1) == 1
    assert routing.pair_row_TK.is_contiguous()
    block_n = GATE_UP_BLOCK_N if activation is not None else DOWN_BLOCK_N
    _int4_moe_gemv_kernel[(triton.cdiv(n, block_n), pairs)](
        a, routing.row_token_R, routing.pair_row_TK, routing.block_expert_B, packed, scale, out_RN,
        n, a.stride(0), packed.stride(0), packed.stride(1), scale.stride(0), scale.stride(1), out_RN.stride(0),
        GROUPS=k // group, GROUP=group, ROW_BLOCK=routing.block_m, GATHER=gather, GATED=activation is not None,
        ACT=ACTIVATIONS[activation] if activation is not None else 0, EMULATE=emulate_rounding(), BLOCK_N=block_n,
        num_warps=GEMV_WARPS,
    )
