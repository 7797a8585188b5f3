"""A few tokens' 16-bit experts: a CUDA-core grouped GEMV, one program row per (token, slot) pair.

At batch-1 decode every routed expert multiplies one row, and the grouped tensor-core
kernel (:mod:`miles_host.kernels.moe_grouped`) pads it to a 16-row MMA block behind a
shared-memory staging of each weight tile. This kernel streams each pair's expert rows
straight from HBM into registers and multiplies on CUDA cores: grid
``(cdiv(N, BLOCK_N), T * K)``; program ``(n, p)`` reads pair ``p``'s padded row ``r``
(``pair_row_TK``), its expert (``block_expert_B[r // block_m]``) and input row (the token
for gate_up, ``r`` for down), keeps ``[BLOCK_N, BLOCK_K]`` fp32 partial sums of exact
bf16 x bf16 products (the next weight tile requested before this one's products), and
writes ``BLOCK_N`` columns of row ``r``: gate_up's gate and up columns together, ending in
the same ``act(gate) * up`` rounding as the grouped kernel's epilogue. Padding rows are
neither read nor written (the combine reads pair rows only). Its numbers are the grouped
kernel's up to the order of the fp32 sums.

``--moe-gemv-tokens N`` (a kernel switch) sets the most tokens that take it (0: never);
expert biases (gpt-oss) and float32 weights keep the grouped kernel. The FP8 and INT4
plugins have GEMVs of the same layout for their weight formats. Reference: the grouped
kernel and :func:`~miles_host.kernels.moe_grouped.grouped_moe_forward_reference` (tests).
"""

from __future__ import annotations

from typing import Any

import torch

from miles_host.kernels import switches

#: ``--moe-gemv-tokens``: most tokens whose 16-bit experts take this kernel
TOKENS = switches.declare("moe_gemv_tokens", 0, None,
                          "most tokens whose 16-bit MoE experts take the CUDA-core grouped GEMV, one program row "
                          "per (token, slot) pair (0: the grouped tensor-core kernel always)")

#: (BLOCK_N, BLOCK_K, warps) by projection: narrow gate_up tiles (each reads gate and up rows) spread a few
#: experts' bytes over more programs than SMs
GATE_UP_TILE = (16, 256, 4)
DOWN_TILE = (32, 256, 4)


def takes_gemv(weight_ENK: torch.Tensor, routing: Any, has_bias: bool) -> bool:
    """16-bit weights without biases, at most ``--moe-gemv-tokens`` tokens (a function of the token
    count, so a captured decode graph always replays the same kernel). ``routing``: the batch's
    :class:`~miles_host.kernels.moe_grouped.Routing`."""
    return (0 < routing.pair_row_TK.shape[0] <= switches.value(TOKENS) and not has_bias
            and weight_ENK.dtype in (torch.bfloat16, torch.float16))


def moe_gemv(a: torch.Tensor, routing: Any, w_ENK: torch.Tensor, out_RN: torch.Tensor, gather: bool,
             activation: str | None) -> None:
    """``out[r] = a[row r] @ w_ENK[expert of r]^T`` for the pair rows of ``routing`` (``activation``: gate_up,
    ``w_ENK [E, 2N, K]`` gate rows first, ``out[r] = act(gate) * up``)."""
    from miles_host.kernels import _moe_gemv_triton

    block_n, block_k, warps = GATE_UP_TILE if activation is not None else DOWN_TILE
    _moe_gemv_triton.moe_gemv(a, routing.pair_row_TK, routing.row_token_R, routing.block_expert_B, routing.block_m,
                              w_ENK, out_RN, gather, activation, block_n, block_k, warps)
