"""FP8 experts in the host's fused MoE: one grouped block-scaled GEMM launch per projection.

:class:`Fp8ExpertGemms` is the :class:`~miles_host.kernels.moe_grouped.ExpertGemms`
of :class:`~miles_fp8.experts.Fp8InferenceExperts`: the host routes the tokens into
its padded row layout and combines the results; this module multiplies.

Per row block (one expert) and ``BLOCK_N`` output columns, for each 128-deep K block:
the ``[BLOCK_M, 128]`` activation tile is quantized in the kernel exactly as
training quantizes activations (:func:`miles_fp8.triton_kernels._quantize_rows`:
1x128 groups, ``scale = max(amax, eps) / 448``, the power-of-two option), the FP8
weight tile ``[128, BLOCK_N]`` of the expert is multiplied with it (FP8 tensor cores
where the GPU has them, else fp16 products of the same E4M3 values), and the
block product is added in fp32 times its two scales: the numbers of
``fp8_inference_linear`` per expert (128x128 weight blocks, 1x128 activation
groups), up to the order of the fp32 sums. gate_up computes gate and up tiles
in the same program and writes ``act(gate) * up`` rounded as the eager bf16
ops round (the host's epilogue); down then quantizes those rows in its own K loop.

Tensor legend: R padded rows, N output columns, K input columns (both multiples of 128).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from miles_host.kernels.triton_common import ACTIVATIONS, act_and_mul, block_rows
from miles_host.kernels.triton_common import cast_rne, emulate_rounding
from miles_fp8.decode_gemm import use_fp8_mma
from miles_fp8.quant import BLOCK
from miles_fp8.triton_kernels import _quantize_rows

#: the tile table's name of this weight format (:mod:`miles_host.kernels.moe_configs`)
WEIGHT_FORMAT = "fp8_block128"


@triton.jit
def _fp8_block_product(x, w, POW2: tl.constexpr, FP8_MMA: tl.constexpr, EMULATE: tl.constexpr):
    """``Q(x) @ w`` of one 128-deep block (unscaled) and x's row scales."""
    q, x_scale = _quantize_rows(x, POW2, EMULATE)
    if FP8_MMA:
        block = tl.dot(q.to(tl.float8e4nv), w)
    else:
        block = tl.dot(q, w.to(tl.float16))
    return block, x_scale


@triton.jit
def _fp8_moe_gemm_kernel(
    A, RowToken, BlockExpert, W, WS, C,
    N, stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_cm,
    K_BLOCKS: tl.constexpr, GATHER: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, POW2: tl.constexpr,
    FP8_MMA: tl.constexpr, EMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, a_rows, row_ok, out_rows = block_rows(RowToken, BlockExpert, pid_m, BLOCK_M, GATHER)
    if expert >= 0:
        # N is a multiple of 128 and BLOCK_N divides 128: no column mask, one weight scale per tile
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        offs_k = tl.arange(0, 128).to(tl.int64)
        a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :]
        w_ptrs = W + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
        ws_ptr = WS + expert.to(tl.int64) * stride_wse + (pid_n * BLOCK_N // 128) * stride_wsn
        ws_up_ptr = WS + expert.to(tl.int64) * stride_wse + ((pid_n * BLOCK_N + N) // 128) * stride_wsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, K_BLOCKS):
            x = tl.load(a_ptrs + kb * 128, mask=row_ok[:, None], other=0.0).to(tl.float32)
            block, x_scale = _fp8_block_product(x, tl.load(w_ptrs + kb * 128), POW2, FP8_MMA, EMULATE)
            acc += block * (x_scale[:, None] * tl.load(ws_ptr + kb))
            if GATED:
                block_up, _ = _fp8_block_product(x, tl.load(w_ptrs + N * stride_wn + kb * 128), POW2, FP8_MMA, EMULATE)
                acc_up += block_up * (x_scale[:, None] * tl.load(ws_up_ptr + kb))
        if GATED:
            out = act_and_mul(acc, acc_up, ACT, C.dtype.element_ty, EMULATE)
        else:
            out = cast_rne(acc, C.dtype.element_ty, EMULATE)
        tl.store(C + out_rows[:, None] * stride_cm + offs_n[None, :], out)


def fp8_moe_gemm(a, routing, w_q, w_scale, out_RN, config, gather: bool, activation: str | None, power_of_two: bool):
    """``out[r] = Q_1x128(a[row r]) @ (w_q * w_scale)[expert of r]^T`` (``activation``: gate_up, see the module doc).

    ``w_q``: float8_e4m3fn ``[E, N, K]`` (``[E, 2N, K]`` gated), ``w_scale``: float32
    ``[E, N/128, K/128]``; ``a``: ``[T, K]`` (``gather``) or ``[R, K]``, bf16/fp16/fp32.
    """
    n, k = out_RN.shape[1], w_q.shape[2]
    num_blocks = routing.block_expert_B.shape[0]
    if num_blocks == 0:
        return
    block_n = min(config.block_n, BLOCK)
    while n % block_n:  # an intermediate of 64 (2I = 128): narrower tiles
        block_n //= 2
    assert a.stride(1) == 1 and w_q.stride(2) == 1 and out_RN.stride(1) == 1 and w_scale.stride(2) == 1
    _fp8_moe_gemm_kernel[(num_blocks, n // block_n)](
        a, routing.row_token_R, routing.block_expert_B, w_q, w_scale, out_RN,
        n, a.stride(0), w_q.stride(0), w_q.stride(1), w_scale.stride(0), w_scale.stride(1), out_RN.stride(0),
        K_BLOCKS=k // BLOCK, GATHER=gather, GATED=activation is not None,
        ACT=ACTIVATIONS[activation] if activation is not None else 0, POW2=power_of_two,
        FP8_MMA=use_fp8_mma(a.device), EMULATE=emulate_rounding(), BLOCK_M=config.block_m, BLOCK_N=block_n,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


@dataclass
class Fp8ExpertGemms:
    """The fused MoE's GEMMs over an ``Fp8InferenceExperts``' stacks (FP8 + 128x128 block scales)."""

    gate_up_q: torch.Tensor
    gate_up_scale: torch.Tensor
    down_q: torch.Tensor
    down_scale: torch.Tensor
    activation: str
    power_of_two: bool

    def __post_init__(self) -> None:
        self.num_experts, two_inter, self.hidden = self.gate_up_q.shape
        self.inter = two_inter // 2
        self.weight_format = WEIGHT_FORMAT

    def gate_up(self, x_TH, routing, out_RI, config) -> None:
        fp8_moe_gemm(x_TH, routing, self.gate_up_q, self.gate_up_scale, out_RI, config, True, self.activation,
                     self.power_of_two)

    def down(self, act_RI, routing, out_RH, config) -> None:
        fp8_moe_gemm(act_RI, routing, self.down_q, self.down_scale, out_RH, config, False, None, self.power_of_two)
