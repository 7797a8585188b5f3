"""INT4 experts in the host's fused MoE: one grouped weight-only INT4 GEMM launch per projection.

:class:`Int4ExpertGemms` is the :class:`~miles_host.kernels.moe_grouped.ExpertGemms`
of :class:`~miles_int4.rollout.Int4Experts`: the host routes the tokens into its
padded row layout and combines the results; this module multiplies.

The weights are read in compressed-tensors' form, as weight sync sends them:
``packed [E, N, K/8]`` int32 (column ``8g + i`` in bits ``4i..4i+3`` of word ``g``,
stored as ``q + 8``) and ``scale [E, N, K/G]`` bf16. Per row block (one expert),
``BLOCK_N`` output columns and ``BLOCK_K`` (dividing G) input columns, a program
loads ``BLOCK_K / 8`` words per column, unpacks them to ``[BLOCK_K, BLOCK_N]``
nibbles and dequantizes ``(q * scale).to(activation dtype)`` (the QAT forward's
weight, :func:`miles_int4.quant.dequantize`, bit for bit) before the tensor-core
product with fp32 accumulation: the numbers of the ``dequant`` rollout GEMM per
expert, up to the order of the fp32 sums, with a quarter of the weight bytes read.

Tensor legend: R padded rows, N output columns, K input columns, G group size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from miles_host.kernels.triton_common import ACTIVATIONS, act_and_mul, block_rows, mma
from miles_host.kernels.triton_common import cast_rne, emulate_rounding
from miles_int4.decode_gemm import _MAGIC_BITS, _MAGIC_OFFSET
from miles_int4.moe_gemv import int4_moe_gemv, takes_gemv
from miles_int4.quant import PACK_FACTOR


@triton.jit
def _int4_moe_gemm_kernel(
    A, RowToken, BlockExpert, W, S, C,
    N, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm,
    K_BLOCKS: tl.constexpr, GROUP: tl.constexpr, GATHER: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
    IEEE: tl.constexpr, EMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, a_rows, row_ok, out_rows = block_rows(RowToken, BlockExpert, pid_m, BLOCK_M, GATHER)
    if expert >= 0:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        cols = tl.where(n_ok, offs_n, 0).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
        words = tl.arange(0, BLOCK_K // 8).to(tl.int64)
        shifts = tl.arange(0, 8) * 4
        a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :]
        w_ptrs = W + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + words[:, None]
        s_ptrs = S + expert.to(tl.int64) * stride_se + cols * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, K_BLOCKS):
            a = tl.load(a_ptrs + kb * BLOCK_K, mask=row_ok[:, None], other=0.0)
            w = _dequantized_tile(w_ptrs + kb * (BLOCK_K // 8), s_ptrs + kb * BLOCK_K // GROUP, shifts,
                                  A.dtype.element_ty, EMULATE, BLOCK_K, BLOCK_N)
            acc = mma(a, w, acc, IEEE, EMULATE)
            if GATED:
                w_up = _dequantized_tile(w_ptrs + N * stride_wn + kb * (BLOCK_K // 8),
                                         s_ptrs + N * stride_sn + kb * BLOCK_K // GROUP, shifts,
                                         A.dtype.element_ty, EMULATE, BLOCK_K, BLOCK_N)
                acc_up = mma(a, w_up, acc_up, IEEE, EMULATE)
        if GATED:
            out = act_and_mul(acc, acc_up, ACT, C.dtype.element_ty, EMULATE)
        else:
            out = cast_rne(acc, C.dtype.element_ty, EMULATE)
        tl.store(C + out_rows[:, None] * stride_cm + offs_n[None, :], out, mask=n_ok[None, :])


@triton.jit
def _dequantized_tile(w_ptrs, s_ptrs, shifts, DTYPE: tl.constexpr, EMULATE: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[BLOCK_K, BLOCK_N]`` of ``(q * scale).to(DTYPE)`` from ``[BLOCK_K / 8, BLOCK_N]`` packed words.

    No int-to-float conversion (as :func:`miles_int4.decode_gemm._dequantize`): bf16 on the GPU, the nibble
    OR-ed into ``0x4300`` is the bf16 ``128 + nibble``, minus 136 is ``q`` exactly, and the bf16 product with
    the scale rounds the exact product once; otherwise the same in float32 with
    ``2^23 + nibble``, one rounding to ``DTYPE``. The QAT forward's weights either way."""
    packed = tl.load(w_ptrs)
    nibbles = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [words, 8, N]: k = 8 * word + i
    nibble = tl.reshape(nibbles, (BLOCK_K, BLOCK_N))
    scale = tl.load(s_ptrs)
    if EMULATE or DTYPE != tl.bfloat16:
        q = (nibble | _MAGIC_BITS).to(tl.float32, bitcast=True) - _MAGIC_OFFSET
        return cast_rne(q * scale.to(tl.float32)[None, :], DTYPE, EMULATE)
    q = (nibble.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True) - 136.0
    return q * scale[None, :]


def int4_moe_gemm(a, routing, packed, scale, out_RN, config, gather: bool, activation: str | None) -> None:
    """``out[r] = a[row r] @ dequantize(packed, scale)[expert of r]^T`` (``activation``: gate_up, ``act(gate) * up``).

    ``packed``: int32 ``[E, N, K/8]`` (``[E, 2N, K/8]`` gated), ``scale``: ``[E, N, K/G]``;
    ``a``: ``[T, K]`` (``gather``) or ``[R, K]``.
    """
    n = out_RN.shape[1]
    k = packed.shape[2] * PACK_FACTOR
    group = k // scale.shape[2]
    num_blocks = routing.block_expert_B.shape[0]
    if num_blocks == 0:
        return
    block_k = min(config.block_k, group)
    assert a.stride(1) == 1 and packed.stride(2) == 1 and scale.stride(2) == 1 and out_RN.stride(1) == 1
    _int4_moe_gemm_kernel[(num_blocks, triton.cdiv(n, config.block_n))](
        a, routing.row_token_R, routing.block_expert_B, packed, scale, out_RN,
        n, a.stride(0), packed.stride(0), packed.stride(1), scale.stride(0), scale.stride(1), out_RN.stride(0),
        K_BLOCKS=k // block_k, GROUP=group, GATHER=gather, GATED=activation is not None,
        ACT=ACTIVATIONS[activation] if activation is not None else 0, IEEE=a.dtype == torch.float32,
        EMULATE=emulate_rounding(), BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


@dataclass
class Int4ExpertGemms:
    """The fused MoE's GEMMs over an ``Int4Experts``' compressed-tensors stacks: one token's rows by the
    CUDA-core GEMV (:mod:`miles_int4.moe_gemv`), more by the grouped tensor-core kernel."""

    gate_up_packed: torch.Tensor
    gate_up_scale: torch.Tensor
    down_packed: torch.Tensor
    down_scale: torch.Tensor
    activation: str

    def __post_init__(self) -> None:
        self.num_experts, two_inter, hidden_words = self.gate_up_packed.shape
        self.hidden = hidden_words * PACK_FACTOR
        self.inter = two_inter // 2
        self.weight_format = f"int4_g{self.hidden // self.gate_up_scale.shape[2]}"

    def gate_up(self, x_TH, routing, out_RI, config) -> None:
        if takes_gemv(x_TH, routing):
            int4_moe_gemv(x_TH, routing, self.gate_up_packed, self.gate_up_scale, out_RI, True, self.activation)
        else:
            int4_moe_gemm(x_TH, routing, self.gate_up_packed, self.gate_up_scale, out_RI, config, True, self.activation)

    def down(self, act_RI, routing, out_RH, config) -> None:
        if takes_gemv(act_RI, routing):
            int4_moe_gemv(act_RI, routing, self.down_packed, self.down_scale, out_RH, False, None)
        else:
            int4_moe_gemm(act_RI, routing, self.down_packed, self.down_scale, out_RH, config, False, None)
