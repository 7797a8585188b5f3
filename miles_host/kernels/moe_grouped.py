"""Grouped-GEMM mixture-of-experts forward: every expert in one launch per projection.

:func:`~miles_host.models.mlp.routed_forward` runs one expert at a time (a host
sync on the per-expert counts, two small GEMMs per expert) and, inside CUDA
graphs, every expert on every token. :func:`grouped_moe_forward` computes the
same thing with a fixed number of launches, no host synchronisation and shapes
that depend on T only, so a decode step can capture it in a CUDA graph:

1. :func:`route` (torch ops on the device): the T*K (token, slot) pairs sorted
   by expert (stable), per-expert counts and starts, and a padded row layout in
   which every expert's rows start at a multiple of ``block_m``. The buffer has
   ``R = ceil((T*K + E*(block_m-1)) / block_m) * block_m`` rows whatever the ids
   (the worst case of the padding), and a per-block expert table marks the
   blocks past the used ones -1 (their programs exit at once).
2. gate_up: one grouped Triton GEMM over the padded rows, the rows of ``x``
   gathered by token index inside the kernel, ``gate_up_E2IH[e]`` read as
   ``[H, 2I]`` through its strides; fp32 accumulation, output in x's dtype.
3. ``act(gate) * up`` on the padded rows (:func:`~miles_host.kernels.activation.silu_and_mul`
   for SiLU, the eager functions of :func:`~miles_host.models.mlp.activation` otherwise).
4. down: the same grouped GEMM with ``down_EHI[e]`` read as ``[I, H]``.
5. :func:`combine`: each token's K rows gathered through the inverse permutation
   in ascending expert order, times their gate weights in fp32 and summed in that
   order in fp32 (the sums of ``_ordered_combine`` in ``mlp.py``; no atomics),
   rounded once to x's dtype.

Opt-in for the model: ``MILES_GROUPED_MOE=1`` (:data:`ENABLED`) makes
``Experts.forward`` call it on CUDA when no gradient is needed and the
batch-invariant mode is off. :func:`grouped_moe_forward_reference` (float64, one
expert at a time) is the oracle of the tests (``tests/kernels/test_moe_grouped.py``).

Tensor legend: T tokens, K experts per token, H hidden, I expert intermediate,
E experts, R padded rows, B row blocks (``R / block_m``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# DTYPES: the activation / weight dtypes of the Triton path (float32 runs ``input_precision="ieee"``)
from miles_host.kernels.invariant_matmul import DTYPES, uses_triton

#: ``Experts.forward`` takes the grouped path when this is set (``MILES_GROUPED_MOE=1``)
ENABLED = os.environ.get("MILES_GROUPED_MOE") == "1"


@dataclass(frozen=True)
class GemmConfig:
    """Tile configuration of one grouped GEMM launch (``block_m`` is the routing's row block)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Routing:
    """The padded row layout of one batch (every tensor on the device, static shapes for a given T).

    ``row_token_R``: int64 ``[R]``, the token a padded row reads (-1: padding);
    ``block_expert_B``: int32 ``[B]``, the expert of each ``block_m`` row block (-1: unused);
    ``pair_row_TK``: int64 ``[T, K]``, the padded row of each token's slots, slots in
    ascending expert order; ``weights_TK``: the gate weights in that same slot order.
    """

    row_token_R: torch.Tensor
    block_expert_B: torch.Tensor
    pair_row_TK: torch.Tensor
    weights_TK: torch.Tensor
    block_m: int


def pick_block_m(num_pairs: int, num_experts: int) -> int:
    """Row block of the layout by the mean rows per expert: 16 for decode, up to 128 for prefill.

    A pure function of T*K and E, so a CUDA graph of a given T always sees one layout.
    """
    per_expert = -(-num_pairs // max(num_experts, 1))
    for block_m in (16, 32, 64):
        if per_expert <= 2 * block_m:
            return block_m
    return 128


def gemm_config(block_m: int, n: int, k: int, dtype: torch.dtype) -> GemmConfig:
    """Tiles of an ``[R, k] x [k, n]`` grouped GEMM with row block ``block_m``."""
    def fit(block: int, size: int) -> int:
        return min(block, max(16, 1 << (max(size, 1) - 1).bit_length()))

    if dtype == torch.float32:
        return GemmConfig(block_m, fit(64, n), fit(32, k), num_warps=4, num_stages=2)
    block_n = 64 if block_m <= 32 else 128
    num_warps = 8 if block_m >= 128 else 4
    return GemmConfig(block_m, fit(block_n, n), fit(64, k), num_warps=num_warps, num_stages=3)


def route(ids_TK: torch.Tensor, weights_TK: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """The padded, expert-sorted row layout of ``ids_TK`` (ids in ``[0, E)``), with torch ops only.

    Counts and starts come from ``searchsorted`` on the sorted ids rather than
    ``bincount`` (CUDA's ``bincount`` reads the largest id on the host).
    """
    num_tokens, top_k = ids_TK.shape
    device = ids_TK.device
    num_pairs = num_tokens * top_k
    num_blocks = -(-(num_pairs + num_experts * (block_m - 1)) // block_m)
    flat_ids = ids_TK.reshape(-1).long()
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    experts = torch.arange(num_experts, device=device)
    first = torch.searchsorted(sorted_ids, experts)  # start of each expert in the sorted pairs
    counts = torch.searchsorted(sorted_ids, experts, right=True) - first
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    rank = torch.arange(num_pairs, device=device) - first.gather(0, sorted_ids)
    row_sorted = starts.gather(0, sorted_ids) + rank  # padded row of the i-th sorted pair

    row_token_R = torch.full((num_blocks * block_m,), -1, dtype=torch.long, device=device)
    row_token_R.scatter_(0, row_sorted, order // top_k)
    pair_row = torch.empty(num_pairs, dtype=torch.long, device=device).scatter_(0, order, row_sorted)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(ends, block_starts, right=True)
    block_expert_B = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)

    slot_order = torch.sort(ids_TK.long(), dim=1, stable=True).indices
    return Routing(
        row_token_R=row_token_R,
        block_expert_B=block_expert_B,
        pair_row_TK=pair_row.view(num_tokens, top_k).gather(1, slot_order),
        weights_TK=weights_TK.gather(1, slot_order),
        block_m=block_m,
    )


def combine(out_RH: torch.Tensor, routing: Routing, dtype: torch.dtype) -> torch.Tensor:
    """``y[t] = sum_k w[t, k] * out[row of (t, k)]`` in fp32, k in ascending expert order, cast once.

    Every product is ``out.float() * w.float()`` and the sum starts from zeros and
    adds one slot at a time: the operations of ``_ordered_combine``.
    """
    num_tokens, top_k = routing.pair_row_TK.shape
    rows_TKH = out_RH.index_select(0, routing.pair_row_TK.reshape(-1)).view(num_tokens, top_k, -1)
    weights_TK = routing.weights_TK.float()
    y_TH = torch.zeros(num_tokens, out_RH.shape[1], dtype=torch.float32, device=out_RH.device)
    for k in range(top_k):
        y_TH += rows_TKH[:, k].float() * weights_TK[:, k, None]
    return y_TH.to(dtype)


def _gated_activation(gate_up_R2I: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` of the padded rows, ``[R, 2I] -> [R, I]`` (contiguous)."""
    if activation == "silu":
        from miles_host.kernels.activation import silu_and_mul

        return silu_and_mul(gate_up_R2I).contiguous()
    from miles_host.models.mlp import activation as eager_activation

    gate_RI, up_RI = gate_up_R2I.chunk(2, dim=-1)
    return (eager_activation(activation)(gate_RI) * up_RI).contiguous()


def _check(x_TH, ids_TK, weights_TK, gate_up_E2IH, down_EHI) -> None:
    num_experts, two_inter, hidden = gate_up_E2IH.shape
    if x_TH.dim() != 2 or x_TH.shape[1] != hidden or two_inter % 2:
        raise ValueError(f"x [T, H] and gate_up [E, 2I, H] disagree: {tuple(x_TH.shape)}, {tuple(gate_up_E2IH.shape)}")
    if tuple(down_EHI.shape) != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"down must be [E, H, I] = {[num_experts, hidden, two_inter // 2]}; got {tuple(down_EHI.shape)}")
    if ids_TK.dim() != 2 or ids_TK.shape != weights_TK.shape or ids_TK.shape[0] != x_TH.shape[0]:
        raise ValueError(f"ids and weights must be [T, K]; got {tuple(ids_TK.shape)}, {tuple(weights_TK.shape)}")
    if x_TH.dtype not in DTYPES or gate_up_E2IH.dtype != x_TH.dtype or down_EHI.dtype != x_TH.dtype:
        raise ValueError(f"x and the expert weights need one dtype among bf16/fp16/fp32; got "
                         f"{x_TH.dtype}, {gate_up_E2IH.dtype}, {down_EHI.dtype}")


def grouped_moe_forward(
    x_TH: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    gate_up_E2IH: torch.Tensor,
    down_EHI: torch.Tensor,
    activation: str = "silu",
    *,
    block_m: int | None = None,
) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` in x's dtype (what ``routed_forward`` with
    ``Experts.expert_mlp`` computes), in a fixed number of launches and no host sync.

    ``ids_TK``: expert ids in ``[0, E)``; ``weights_TK``: gate weights (any float
    dtype, used in fp32); ``gate_up_E2IH``: ``[E, 2I, H]`` (gate rows first),
    ``down_EHI``: ``[E, H, I]``, any strides. ``block_m``: the layout's row block
    (tests; default :func:`pick_block_m`). On CUDA (and on CPU under
    ``TRITON_INTERPRET=1``) the Triton path; elsewhere :func:`grouped_moe_forward_reference`.
    No autograd (inference only).
    """
    _check(x_TH, ids_TK, weights_TK, gate_up_E2IH, down_EHI)
    num_tokens, top_k = ids_TK.shape
    num_experts, two_inter, hidden = gate_up_E2IH.shape
    if num_tokens == 0 or top_k == 0:
        return torch.zeros_like(x_TH)
    if not uses_triton(x_TH):
        return grouped_moe_forward_reference(x_TH, ids_TK, weights_TK, gate_up_E2IH, down_EHI, activation)
    from miles_host.kernels import _moe_grouped_triton

    block_m = block_m or pick_block_m(num_tokens * top_k, num_experts)
    routing = route(ids_TK, weights_TK, num_experts, block_m)
    num_rows = routing.row_token_R.shape[0]

    gate_up_R2I = x_TH.new_empty(num_rows, two_inter)
    _moe_grouped_triton.grouped_mm(
        x_TH, routing.row_token_R, routing.block_expert_B, gate_up_E2IH.transpose(1, 2), gate_up_R2I,
        gemm_config(block_m, two_inter, hidden, x_TH.dtype), gather=True,
    )
    act_RI = _gated_activation(gate_up_R2I, activation)
    out_RH = x_TH.new_empty(num_rows, hidden)
    _moe_grouped_triton.grouped_mm(
        act_RI, routing.row_token_R, routing.block_expert_B, down_EHI.transpose(1, 2), out_RH,
        gemm_config(block_m, hidden, two_inter // 2, x_TH.dtype), gather=False,
    )
    return combine(out_RH, routing, x_TH.dtype)


def grouped_moe_forward_reference(
    x_TH: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    gate_up_E2IH: torch.Tensor,
    down_EHI: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """Plain PyTorch, one expert at a time in float64, rounded once to x's dtype (the oracle)."""
    from miles_host.models.mlp import activation as eager_activation

    act = eager_activation(activation)
    y_TH = torch.zeros(x_TH.shape, dtype=torch.float64, device=x_TH.device)
    for expert in range(gate_up_E2IH.shape[0]):
        tokens, slots = torch.nonzero(ids_TK == expert, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate, up = (x_TH[tokens].double() @ gate_up_E2IH[expert].double().t()).chunk(2, dim=-1)
        out = (act(gate) * up) @ down_EHI[expert].double().t()
        y_TH.index_add_(0, tokens, out * weights_TK[tokens, slots].double()[:, None])
    return y_TH.to(x_TH.dtype)
