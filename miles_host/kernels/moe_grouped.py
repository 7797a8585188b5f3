"""Fused mixture-of-experts forward: every expert in one launch per projection, no host sync.

:func:`~miles_host.models.mlp.routed_forward` runs one expert at a time (a host
sync on the per-expert counts, two small GEMMs per expert) and, inside CUDA
graphs, every expert on every token. :func:`fused_moe` computes the same thing
in four launches, with no host synchronisation and shapes that depend on T only,
so a decode step captures it in a CUDA graph and a prefill runs it as it comes:

1. :func:`plan`: the T*K (token, slot) pairs sorted by expert (stable) into a
   padded row layout in which every expert's rows start at a multiple of
   ``block_m`` (for decode-sized batches the MoE block gets it together with the
   top-k from :func:`~miles_host.kernels.moe_router.fused_route`, one launch for
   router and layout, and passes it in). The buffer has ``R = max_row_blocks(T*K, E, block_m) * block_m``
   rows whatever the ids (the worst case of the padding), and a per-block expert
   table marks the blocks past the used ones -1 (their programs exit at once).
   Up to :data:`ROUTE_KERNEL_MAX_PAIRS` pairs (decode, small prefills) this is one
   Triton program; above, :func:`route`'s torch ops (same layout).
2. gate_up: one grouped GEMM over the padded rows, ``x``'s rows gathered by token
   inside the kernel, gate and up tiles of ``gate_up_E2IH[e]`` in the same program
   and ``act(gate) * up`` in its epilogue (the activation never goes to memory
   un-multiplied). gpt-oss' experts add their bias rows to the fp32 accumulators
   and take the clamped SwiGLU (:data:`CLAMPED_SWIGLU`) in the same epilogue.
3. down: the same grouped GEMM on the activation rows with ``down_EHI[e]`` (and
   its bias rows).
4. :func:`combine`: each token's K rows times their gate weights, summed in fp32
   in slot order and rounded once to x's dtype, in one launch.

Steps 2 and 3 are an :class:`ExpertGemms`: :class:`DenseExpertGemms` for the host's
bf16/fp16/fp32 experts; precision plugins (FP8, INT4) provide their own with the
weights in their format and the same layout. Tiles come from
:mod:`miles_host.kernels.moe_configs` (a swept table by shape and token bucket).

``Experts.forward`` takes this path on CUDA for inference (no autograd) unless
the batch-invariant mode is on or the module's ``moe_kernel`` is ``"loop"``
(``--moe-kernel loop``). :func:`grouped_moe_forward_reference` (float64, one
expert at a time) is the oracle of the tests (``tests/kernels/test_moe_grouped.py``).

Tensor legend: T tokens, K experts per token, H hidden, I expert intermediate,
E experts, R padded rows, B row blocks (``R / block_m``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from miles_host.kernels import switches
from miles_host.kernels.eager_ops import activation as eager_activation
from miles_host.kernels.eager_ops import gated_activation

# DTYPES: the activation / weight dtypes of the Triton path (float32 runs ``input_precision="ieee"``)
from miles_host.kernels.invariant_matmul import DTYPES, uses_triton
from miles_host.kernels.moe_configs import (
    GEMV_LAUNCHES, GemmConfig, MoETiles, gemm_config, max_row_blocks, moe_tiles, pick_block_m,
)

__all__ = [
    "CLAMPED_SWIGLU", "DenseExpertGemms", "ExpertGemms", "GemmConfig", "MoETiles", "Routing", "combine", "fused_moe",
    "fuses", "gemm_config", "grouped_moe_forward", "grouped_moe_forward_reference", "max_row_blocks", "pick_block_m",
    "plan", "route",
]

#: ``--moe-combine``: the top-k weighted sum as its own launch (``separate``, :func:`combine`) or in the
#: down projection's launch (``epilogue``: in the grouped GEMM the last of a token's rows to finish sums
#: them; in the one-pair GEMV a program sums a token's slots,
#: :func:`~miles_host.kernels._moe_grouped_triton.moe_gemv_combine`; the same bits, one launch fewer per MoE
#: layer; the host's bf16/fp16/fp32 experts). ``separate`` stays the default: on an H100 batch-1 decode ran
#: 1,280 tok/s with the epilogue against 1,296 (bench/history/2026-12-07-2.md)
COMBINE = switches.declare_host("moe_combine")

#: ``--moe-gemv-tokens``: batches of at most this many tokens run the host's 16-bit experts by a CUDA-core
#: GEMV per (token, slot) pair (:func:`~miles_host.kernels._moe_grouped_triton.moe_gemv`) instead of the
#: grouped GEMM; 0: never. Default 1: batch-1 decode on an H100 (bf16 Qwen3-30B-A3B shape) ran 1,154 against
#: 1,091 tok/s with the grouped GEMM, the other decode switches on (bench/history/2026-12-06-6.md)
GEMV_TOKENS = switches.declare_host("moe_gemv_tokens")

#: (token, slot) pairs up to which :func:`plan` routes in one Triton program (above: torch ops)
ROUTE_KERNEL_MAX_PAIRS = 4096

#: activations the gate_up epilogue computes
FUSED_ACTIVATIONS = ("silu", "gelu_tanh", "gelu")

#: gpt-oss' clamped SwiGLU, which the gate_up epilogue computes too, given its limit and alpha
#: (:class:`DenseExpertGemms`; the precision plugins' kernels take only :data:`FUSED_ACTIVATIONS`)
CLAMPED_SWIGLU = "clamped_swiglu"

#: weight-format name of the host's expert stacks by dtype (the tile table's key)
DENSE_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Routing:
    """The padded row layout of one batch (every tensor on the device, static shapes for a given T).

    ``row_token_R``: int64 ``[R]``, the token a padded row reads (-1: padding);
    ``block_expert_B``: int32 ``[B]``, the expert of each ``block_m`` row block (-1: unused);
    ``pair_row_TK``: int64 ``[T, K]``, the padded row of each token's slots;
    ``weights_TK``: the gate weights in that same slot order.
    """

    row_token_R: torch.Tensor
    block_expert_B: torch.Tensor
    pair_row_TK: torch.Tensor
    weights_TK: torch.Tensor
    block_m: int


class ExpertGemms(Protocol):
    """The two grouped GEMMs of one expert stack, over a :class:`Routing` layout.

    A precision plugin implements this for its weight format; ``weight_format``
    names it in the tile table (:func:`~miles_host.kernels.moe_configs.moe_tiles`).
    """

    num_experts: int
    hidden: int
    inter: int
    weight_format: str

    def gate_up(self, x_TH: torch.Tensor, routing: Routing, out_RI: torch.Tensor, config: GemmConfig) -> None:
        """``out[r] = act(x[token of r] @ gate[e]^T) * (x[token of r] @ up[e]^T)`` for the rows of used blocks."""
        ...

    def down(self, act_RI: torch.Tensor, routing: Routing, out_RH: torch.Tensor, config: GemmConfig) -> None:
        """``out[r] = act[r] @ down[e]^T`` for the rows of used blocks."""
        ...


@dataclass
class DenseExpertGemms:
    """The host's expert stacks: ``gate_up_E2IH [E, 2I, H]`` (gate rows first), ``down_EHI [E, H, I]``;
    gpt-oss' ``gate_up_bias_E2I [E, 2I]`` and ``down_bias_EH [E, H]`` where given, and its clamped
    SwiGLU as ``activation`` :data:`CLAMPED_SWIGLU` with ``swiglu_limit`` and ``swiglu_alpha``."""

    gate_up_E2IH: torch.Tensor
    down_EHI: torch.Tensor
    activation: str = "silu"
    gate_up_bias_E2I: torch.Tensor | None = None
    down_bias_EH: torch.Tensor | None = None
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0

    def __post_init__(self) -> None:
        self.num_experts, two_inter, self.hidden = self.gate_up_E2IH.shape
        self.inter = two_inter // 2
        self.weight_format = DENSE_FORMATS.get(self.gate_up_E2IH.dtype, str(self.gate_up_E2IH.dtype))
        if not fuses(self.activation, self.swiglu_limit):
            raise ValueError(f"the fused MoE takes the activations {FUSED_ACTIVATIONS} and {CLAMPED_SWIGLU!r} with "
                             f"a swiglu_limit; got {self.activation!r} with swiglu_limit={self.swiglu_limit} "
                             "(use --moe-kernel loop)")

    def takes_gemv(self, routing: Routing, dtype: torch.dtype) -> bool:
        """Whether both projections of this batch run the one-pair CUDA-core GEMV (``--moe-gemv-tokens``):
        at most that many tokens, no biases, an activation of :data:`FUSED_ACTIVATIONS`, 16-bit
        activations and weights with unit inner strides. One answer for both: under PDL the down GEMV
        reads the routing before its wait, which only the gate_up GEMV before it allows."""
        return (0 < routing.pair_row_TK.shape[0] <= switches.value(GEMV_TOKENS)
                and self.gate_up_bias_E2I is None and self.down_bias_EH is None
                and self.activation in FUSED_ACTIVATIONS and dtype in (torch.bfloat16, torch.float16)
                and self.gate_up_E2IH.stride(2) == 1 and self.down_EHI.stride(2) == 1)

    def gate_up(self, x_TH, routing, out_RI, config) -> None:
        from miles_host.kernels import _moe_grouped_triton

        if self.takes_gemv(routing, x_TH.dtype):
            _moe_grouped_triton.moe_gemv(x_TH.contiguous(), routing, self.gate_up_E2IH, out_RI, gather=True,
                                         activation=self.activation, launch=GEMV_LAUNCHES["gate_up"])
            return
        _moe_grouped_triton.moe_gemm(x_TH, routing.row_token_R, routing.block_expert_B, self.gate_up_E2IH, out_RI,
                                     config, gather=True, activation=self.activation, bias_EN=self.gate_up_bias_E2I,
                                     swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha)

    def down(self, act_RI, routing, out_RH, config, y_TH: torch.Tensor | None = None) -> None:
        """``y_TH``: also the top-k weighted sum of each token's rows into it, in the same launch
        (:func:`fused_moe` under ``--moe-combine epilogue``; what :func:`combine` computes, bit for bit)."""
        from miles_host.kernels import _moe_grouped_triton

        if self.takes_gemv(routing, act_RI.dtype):
            if y_TH is not None:
                _moe_grouped_triton.moe_gemv_combine(act_RI, routing, self.down_EHI, y_TH,
                                                     GEMV_LAUNCHES["down_combine"])
            else:
                _moe_grouped_triton.moe_gemv(act_RI, routing, self.down_EHI, out_RH, gather=False, activation=None,
                                             launch=GEMV_LAUNCHES["down"])
            return
        combine = (routing.pair_row_TK, routing.weights_TK.contiguous(), y_TH) if y_TH is not None else None
        _moe_grouped_triton.moe_gemm(act_RI, routing.row_token_R, routing.block_expert_B, self.down_EHI, out_RH,
                                     config, gather=False, activation=None, bias_EN=self.down_bias_EH,
                                     combine=combine)

    #: :meth:`down` takes ``y_TH`` (the combine in its epilogue)
    combines_in_down = True


def fuses(activation: str, swiglu_limit: float | None = None) -> bool:
    """Whether the gate_up epilogue computes ``activation``: one of :data:`FUSED_ACTIVATIONS`
    (no limit), or :data:`CLAMPED_SWIGLU` with its ``swiglu_limit``."""
    if activation == CLAMPED_SWIGLU:
        return swiglu_limit is not None
    return activation in FUSED_ACTIVATIONS and swiglu_limit is None


def route(ids_TK: torch.Tensor, weights_TK: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """The padded, expert-sorted row layout of ``ids_TK`` (ids in ``[0, E)``), with torch ops only.

    Counts and starts come from ``searchsorted`` on the sorted ids rather than
    ``bincount`` (CUDA's ``bincount`` reads the largest id on the host). Slots of
    a token are listed in ascending expert order.
    """
    num_tokens, top_k = ids_TK.shape
    device = ids_TK.device
    num_pairs = num_tokens * top_k
    num_blocks = max_row_blocks(num_pairs, num_experts, block_m)
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


def plan(ids_TK: torch.Tensor, weights_TK: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """The layout of :func:`route`; one Triton launch up to :data:`ROUTE_KERNEL_MAX_PAIRS` pairs
    (slots then in their own order), :func:`route` above or where Triton does not run."""
    num_tokens, top_k = ids_TK.shape
    num_pairs = num_tokens * top_k
    if not uses_triton(ids_TK) or num_pairs > ROUTE_KERNEL_MAX_PAIRS or num_pairs == 0:
        return route(ids_TK, weights_TK, num_experts, block_m)
    from miles_host.kernels import _moe_grouped_triton

    num_blocks = max_row_blocks(num_pairs, num_experts, block_m)
    row_token_R = torch.empty(num_blocks * block_m, dtype=torch.long, device=ids_TK.device)
    pair_row_TK = torch.empty(num_tokens, top_k, dtype=torch.long, device=ids_TK.device)
    block_expert_B = torch.empty(num_blocks, dtype=torch.int32, device=ids_TK.device)
    _moe_grouped_triton.route_layout(ids_TK.contiguous(), num_experts, block_m, row_token_R, pair_row_TK, block_expert_B)
    return Routing(row_token_R, block_expert_B, pair_row_TK, weights_TK, block_m)


def combine(out_RH: torch.Tensor, routing: Routing, dtype: torch.dtype) -> torch.Tensor:
    """``y[t] = sum_k w[t, k] * out[row of (t, k)]`` in fp32, k in slot order, cast once (one launch where
    Triton runs; the same products and sums in torch ops elsewhere)."""
    num_tokens, top_k = routing.pair_row_TK.shape
    if uses_triton(out_RH):
        from miles_host.kernels import _moe_grouped_triton

        y_TH = torch.empty(num_tokens, out_RH.shape[1], dtype=dtype, device=out_RH.device)
        return _moe_grouped_triton.combine(out_RH, routing.pair_row_TK, routing.weights_TK.contiguous(), y_TH)
    rows_TKH = out_RH.index_select(0, routing.pair_row_TK.reshape(-1)).view(num_tokens, top_k, -1)
    weights_TK = routing.weights_TK.float()
    y_TH = torch.zeros(num_tokens, out_RH.shape[1], dtype=torch.float32, device=out_RH.device)
    for k in range(top_k):
        y_TH += rows_TKH[:, k].float() * weights_TK[:, k, None]
    return y_TH.to(dtype)


def fused_moe(
    x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, gemms: ExpertGemms,
    tiles: MoETiles | None = None, routing: Routing | None = None,
) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` in x's dtype through ``gemms`` (where Triton runs).

    ``ids_TK``: expert ids in ``[0, E)``; ``weights_TK``: gate weights (any float
    dtype, used in fp32). ``tiles``: the launches' tiles (tests, the sweep; default
    the table's). ``routing``: the layout of these ids and weights when the caller
    already has it (:func:`~miles_host.kernels.moe_router.fused_route`); used when its
    row block is the tiles', else :func:`plan` runs. No autograd.
    """
    num_tokens, top_k = ids_TK.shape
    if num_tokens == 0 or top_k == 0:
        return torch.zeros_like(x_TH)
    tiles = tiles or moe_tiles(num_tokens, top_k, gemms.num_experts, gemms.hidden, gemms.inter, x_TH.dtype,
                               gemms.weight_format)
    if routing is None or routing.block_m != tiles.block_m:
        routing = plan(ids_TK, weights_TK, gemms.num_experts, tiles.block_m)
    num_rows = routing.row_token_R.shape[0]
    act_RI = x_TH.new_empty(num_rows, gemms.inter)
    gemms.gate_up(x_TH, routing, act_RI, tiles.gate_up)
    out_RH = x_TH.new_empty(num_rows, gemms.hidden)
    if switches.value(COMBINE) == "epilogue" and getattr(gemms, "combines_in_down", False) and uses_triton(x_TH):
        y_TH = torch.empty(num_tokens, gemms.hidden, dtype=x_TH.dtype, device=x_TH.device)
        gemms.down(act_RI, routing, out_RH, tiles.down, y_TH=y_TH)
        return y_TH
    gemms.down(act_RI, routing, out_RH, tiles.down)
    return combine(out_RH, routing, x_TH.dtype)


def _check(x_TH, ids_TK, weights_TK, gate_up_E2IH, down_EHI, gate_up_bias_E2I, down_bias_EH) -> None:
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
    for name, bias, weight in (("gate_up", gate_up_bias_E2I, gate_up_E2IH), ("down", down_bias_EH, down_EHI)):
        if bias is not None and (tuple(bias.shape) != tuple(weight.shape[:2]) or bias.dtype != weight.dtype):
            raise ValueError(f"the {name} bias must be {list(weight.shape[:2])} in {weight.dtype}; "
                             f"got {tuple(bias.shape)} in {bias.dtype}")


def grouped_moe_forward(
    x_TH: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    gate_up_E2IH: torch.Tensor,
    down_EHI: torch.Tensor,
    activation: str = "silu",
    *,
    block_m: int | None = None,
    gate_up_bias_E2I: torch.Tensor | None = None,
    down_bias_EH: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.0,
) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` in x's dtype (what ``routed_forward`` with
    ``Experts.expert_mlp`` computes), in a fixed number of launches and no host sync.

    ``ids_TK``: expert ids in ``[0, E)``; ``weights_TK``: gate weights (any float
    dtype, used in fp32); ``gate_up_E2IH``: ``[E, 2I, H]`` (gate rows first),
    ``down_EHI``: ``[E, H, I]``, any strides. ``block_m``: the layout's row block
    (tests; default: the tile table's). gpt-oss: the experts' biases
    (``gate_up_bias_E2I [E, 2I]``, ``down_bias_EH [E, H]``) and ``activation``
    :data:`CLAMPED_SWIGLU` with ``swiglu_limit`` / ``swiglu_alpha``. On CUDA (and on CPU under
    ``TRITON_INTERPRET=1``) the Triton path; elsewhere :func:`grouped_moe_forward_reference`.
    No autograd (inference only).
    """
    _check(x_TH, ids_TK, weights_TK, gate_up_E2IH, down_EHI, gate_up_bias_E2I, down_bias_EH)
    if ids_TK.shape[0] == 0 or ids_TK.shape[1] == 0:
        return torch.zeros_like(x_TH)
    gemms = DenseExpertGemms(gate_up_E2IH, down_EHI, activation, gate_up_bias_E2I, down_bias_EH, swiglu_limit,
                             swiglu_alpha)
    if not uses_triton(x_TH):
        return _reference(x_TH, ids_TK, weights_TK, gemms)
    tiles = None
    if block_m is not None:
        tiles = MoETiles(block_m, gemm_config(block_m, gemms.inter, gemms.hidden, x_TH.dtype),
                         gemm_config(block_m, gemms.hidden, gemms.inter, x_TH.dtype))
    return fused_moe(x_TH, ids_TK, weights_TK, gemms, tiles)


def grouped_moe_forward_reference(
    x_TH: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    gate_up_E2IH: torch.Tensor,
    down_EHI: torch.Tensor,
    activation: str = "silu",
    *,
    gate_up_bias_E2I: torch.Tensor | None = None,
    down_bias_EH: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.0,
) -> torch.Tensor:
    """Plain PyTorch, one expert at a time in float64, rounded once to x's dtype (the oracle);
    arguments as :func:`grouped_moe_forward`'s."""
    gemms = DenseExpertGemms(gate_up_E2IH, down_EHI, activation, gate_up_bias_E2I, down_bias_EH, swiglu_limit,
                             swiglu_alpha)
    return _reference(x_TH, ids_TK, weights_TK, gemms)


def _reference(x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
               gemms: DenseExpertGemms) -> torch.Tensor:
    act = eager_activation(gemms.activation) if gemms.swiglu_limit is None else None
    y_TH = torch.zeros(x_TH.shape, dtype=torch.float64, device=x_TH.device)
    for expert in range(gemms.num_experts):
        tokens, slots = torch.nonzero(ids_TK == expert, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = x_TH[tokens].double() @ gemms.gate_up_E2IH[expert].double().t()
        if gemms.gate_up_bias_E2I is not None:
            gate_up = gate_up + gemms.gate_up_bias_E2I[expert].double()
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = gated_activation(gate, up, act, gemms.swiglu_limit, gemms.swiglu_alpha)
        out = hidden @ gemms.down_EHI[expert].double().t()
        if gemms.down_bias_EH is not None:
            out = out + gemms.down_bias_EH[expert].double()
        y_TH.index_add_(0, tokens, out * weights_TK[tokens, slots].double()[:, None])
    return y_TH.to(x_TH.dtype)
