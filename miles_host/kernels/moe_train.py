"""Grouped-GEMM mixture-of-experts for training: forward and backward, no host sync.

:func:`~miles_host.models.mlp.routed_forward` runs one expert at a time: a host
sync on the per-expert counts, then two small GEMMs per expert from Python.
:func:`grouped_experts` computes the same function with a fixed number of
launches whose shapes depend on T, K and E only (never on the routing), so
autograd, activation recomputation and R3 replay see the same graph every time:

1. :func:`expert_layout` (device ops): the T*K (token, slot) pairs sorted by
   expert (stable), each expert's rows padded to a multiple of :data:`ALIGN_ROWS`
   (``_grouped_mm`` wants 16-byte aligned groups, and the padding keeps the
   weight-gradient GEMMs' contraction ranges aligned too). The layout has
   ``R = T*K + E*(ALIGN_ROWS - 1)`` rows whatever the ids; the last expert's group
   runs to row R, so every row is computed and padding rows stay zero.
2. Permute: ``x_R = x[token of row]`` (padding rows read a zero row). Backward:
   each token's K row gradients gathered and summed, no atomics.
3. ``gate_up = grouped_mm(x_R, gate_up_E2IH^T)``, ``act(gate) * up``,
   ``out = grouped_mm(act_RI, down_EHI^T)``: ``torch._grouped_mm`` (CUTLASS on
   sm90 in bf16) whose autograd gives the x and weight gradients. gpt-oss' experts
   add each row's expert bias to both projections (bias rows gathered by the row's
   expert: autograd sums each expert's rows into its bias gradient, in float32) and
   take the clamped SwiGLU instead of ``act(gate) * up`` (plain torch ops on the
   grouped output, :func:`~miles_host.kernels.eager_ops.gated_activation`).
4. Unpermute and combine: ``y[t] = sum_k w[t, k] * out[row of (t, k)]`` as one
   batched ``[1, K] x [K, H]`` product per token in the promoted dtype of ``out``
   and the weights, so the gate weights (and through them the router) get
   ``dw[t, k] = <out[row of (t, k)], dy[t]>``.

LoRA on the experts (:mod:`miles_host.lora.experts`) passes each stack's low-rank pair
(:class:`StackAdapter`): step 3's projections become ``grouped_mm(x, W^T) + scaling *
grouped_mm(grouped_mm(x, A^T), B^T)``, so autograd keeps ``[R, rank]`` activations instead of
merged ``[E, out, in]`` stacks, and no full-size weight gradient is formed
(:func:`low_rank_fits`: where ``_grouped_mm``'s 16-byte alignment allows the rank).

The routing ids come in from the caller (``RoutingHooks.select``: the router's
choice or an R3 replay); the gate weights carry the router's gradient.

Which path ``Experts.forward`` takes with gradients on is ``MoEConfig.experts_impl``
(:data:`EXPERTS_IMPLS`): ``auto`` takes this one where ``_grouped_mm`` runs its
bf16 kernel (CUDA, compute capability 9.x or 10.x, bf16 or bf16 autocast, H and I
multiples of 8) and the per-expert loop elsewhere; ``grouped`` takes it
everywhere (CPU tests: ``_grouped_mm``'s CPU kernel, or :func:`grouped_mm_loop`
where torch has none); ``loop`` keeps the per-expert loop (the baseline of
``bench/moe_train.py``). The batch-invariant mode keeps its own fixed-order path.

Tensor legend: T tokens, K experts per token, H hidden, I expert intermediate,
E experts, R rows of the expert-sorted layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from miles_host.kernels.eager_ops import gated_activation

#: rows each expert's group is padded to a multiple of (16 bytes of bf16 is 8; 16 also suits fp16/fp8)
ALIGN_ROWS = 16


@dataclass(frozen=True)
class ExpertLayout:
    """Where each (token, slot) pair sits in the expert-sorted rows (all tensors on the device).

    ``row_token_R``: int64 ``[R]``, the token a row reads (T: a padding row, which reads zeros);
    ``pair_row_TK``: int64 ``[T, K]``, the row of each token's slots;
    ``offsets_E``: int32 ``[E]``, cumulative row ends of the expert groups (the last is R).
    """

    row_token_R: torch.Tensor
    pair_row_TK: torch.Tensor
    offsets_E: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.row_token_R.shape[0]


def expert_layout(ids_TK: torch.Tensor, num_experts: int, align: int = ALIGN_ROWS) -> ExpertLayout:
    """The padded expert-sorted layout of ``ids_TK`` (ids in ``[0, E)``), with device ops only.

    Counts come from ``searchsorted`` on the sorted ids (CUDA's ``bincount`` reads the
    largest id on the host).
    """
    num_tokens, top_k = ids_TK.shape
    device = ids_TK.device
    num_pairs = num_tokens * top_k
    num_rows = num_pairs + num_experts * (align - 1)
    sorted_ids, order = torch.sort(ids_TK.reshape(-1).long(), stable=True)
    experts = torch.arange(num_experts, device=device)
    first = torch.searchsorted(sorted_ids, experts)  # each expert's first pair in the sorted order
    counts = torch.searchsorted(sorted_ids, experts, right=True) - first
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    rank = torch.arange(num_pairs, device=device) - first.gather(0, sorted_ids)
    row_sorted = starts.gather(0, sorted_ids) + rank  # the row of the i-th sorted pair
    row_token_R = torch.full((num_rows,), num_tokens, dtype=torch.long, device=device)
    row_token_R.scatter_(0, row_sorted, order // top_k)
    pair_row = torch.empty(num_pairs, dtype=torch.long, device=device).scatter_(0, order, row_sorted)
    # the last group runs to the end: the spare padding rows are computed (zeros), never left unwritten
    offsets_E = torch.cat([ends[:-1], ends.new_full((1,), num_rows)]).to(torch.int32)
    return ExpertLayout(row_token_R, pair_row.view(num_tokens, top_k), offsets_E)


class _PermuteTokens(torch.autograd.Function):
    """``x_R = x[row_token_R]`` (``[x; 0]`` where a row reads token T: a padding row); backward
    sums each token's K row gradients (no atomics)."""

    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, row_token_R: torch.Tensor, pair_row_TK: torch.Tensor,
                padding_rows: bool) -> torch.Tensor:
        ctx.save_for_backward(pair_row_TK)
        source_TH = torch.cat([x_TH, x_TH.new_zeros(1, x_TH.shape[1])]) if padding_rows else x_TH
        return source_TH.index_select(0, row_token_R)

    @staticmethod
    def backward(ctx, grad_RH: torch.Tensor):
        (pair_row_TK,) = ctx.saved_tensors
        num_tokens, top_k = pair_row_TK.shape
        grad_TKH = grad_RH.index_select(0, pair_row_TK.reshape(-1)).view(num_tokens, top_k, grad_RH.shape[1])
        return grad_TKH.sum(dim=1), None, None, None


def permute_tokens(x_TH: torch.Tensor, row_token_R: torch.Tensor, pair_row_TK: torch.Tensor,
                   padding_rows: bool = True) -> torch.Tensor:
    """Row ``r`` of the result is token ``row_token_R[r]`` of ``x`` (token T: a zero padding row,
    where ``padding_rows``); ``pair_row_TK`` ``[T, K]`` names the K rows each token went to
    (every token exactly K). Differentiable in ``x``: its gradient gathers and sums each token's
    K row gradients, where ``index_select``'s backward would add them with atomics."""
    return _PermuteTokens.apply(x_TH, row_token_R, pair_row_TK, padding_rows)


class _UnpermuteRows(torch.autograd.Function):
    """``out_TKH = out_R[pair_row_TK]`` (each row read at most once); backward scatters back."""

    @staticmethod
    def forward(ctx, out_RH: torch.Tensor, pair_row_TK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(pair_row_TK)
        ctx.num_rows = out_RH.shape[0]
        num_tokens, top_k = pair_row_TK.shape
        return out_RH.index_select(0, pair_row_TK.reshape(-1)).view(num_tokens, top_k, out_RH.shape[1])

    @staticmethod
    def backward(ctx, grad_TKH: torch.Tensor):
        (pair_row_TK,) = ctx.saved_tensors
        grad_RH = grad_TKH.new_zeros(ctx.num_rows, grad_TKH.shape[-1])
        grad_RH.index_copy_(0, pair_row_TK.reshape(-1), grad_TKH.reshape(-1, grad_TKH.shape[-1]))
        return grad_RH, None


def unpermute_rows(out_RH: torch.Tensor, pair_row_TK: torch.Tensor) -> torch.Tensor:
    """``[T, K, H]``: the rows ``pair_row_TK`` of ``out`` (no row named twice). Differentiable in
    ``out``: its gradient is copied back to those rows (``index_select``'s backward would add
    with atomics), the other rows' gradient zero."""
    return _UnpermuteRows.apply(out_RH, pair_row_TK)


def grouped_mm_loop(a_MK: torch.Tensor, b_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """``_grouped_mm(a, b, offs=offsets)`` for a 2-D ``a`` and 3-D ``b``, one matmul per group
    (reads the offsets on the host; for torch builds without ``_grouped_mm``)."""
    ends = offsets_E.tolist()
    starts = [0, *ends[:-1]]
    return torch.cat([a_MK[start:end] @ b_EKN[e] for e, (start, end) in enumerate(zip(starts, ends))])


def grouped_mm(a_MK: torch.Tensor, b_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Rows ``[offsets[e-1], offsets[e])`` of ``a`` times ``b[e]``; differentiable."""
    if hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(a_MK, b_EKN, offs=offsets_E)
    return grouped_mm_loop(a_MK, b_EKN, offsets_E)


@dataclass(frozen=True)
class StackAdapter:
    """A LoRA update of one expert stack: expert ``e``'s weight is ``W_e + scaling * B_e @ A_e``
    (``a_ERI`` ``[E, rank, in]``, ``b_EOR`` ``[E, out, rank]``)."""

    a_ERI: torch.Tensor
    b_EOR: torch.Tensor
    scaling: float


def low_rank_fits(rank: int, dtype: torch.dtype) -> bool:
    """Whether ``grouped_mm`` takes ``rank``-wide operands in ``dtype``: ``_grouped_mm`` wants
    16-byte aligned rows (bf16: a rank that is a multiple of 8)."""
    return rank * dtype.itemsize % 16 == 0


def _project(x_RI: torch.Tensor, weight_EOI: torch.Tensor, adapter: StackAdapter | None,
             offsets_E: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each row group times its expert's ``weight^T``, plus the group's low-rank update if any."""
    y_RO = grouped_mm(x_RI, weight_EOI.to(dtype).transpose(1, 2), offsets_E)
    if adapter is None:
        return y_RO
    low_RR = grouped_mm(x_RI, adapter.a_ERI.to(dtype).transpose(1, 2), offsets_E)
    return y_RO + adapter.scaling * grouped_mm(low_RR, adapter.b_EOR.to(dtype).transpose(1, 2), offsets_E)


def _add_expert_bias(y_RO: torch.Tensor, bias_EO: torch.Tensor | None, offsets_E: torch.Tensor) -> torch.Tensor:
    """``y[r] + bias[expert of row r]`` in y's dtype. ``_grouped_mm`` has no bias epilogue, so
    in bf16 the sum is rounded once more than ``F.linear(x, w, b)`` rounds it. The gathered rows
    come from a float32 copy of the bias, so its gradient sums each expert's rows in float32."""
    if bias_EO is None:
        return y_RO
    rows_R = torch.arange(y_RO.shape[0], device=y_RO.device, dtype=offsets_E.dtype)
    row_expert_R = torch.searchsorted(offsets_E, rows_R, right=True)  # the group whose end is past the row
    return y_RO + bias_EO.float().index_select(0, row_expert_R).to(y_RO.dtype)


def compute_dtype(x_TH: torch.Tensor) -> torch.dtype:
    """The dtype the expert GEMMs run in: autocast's where it is on, else x's."""
    device_type = x_TH.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x_TH.dtype


def _bf16_kernel_runs(x_TH: torch.Tensor, gate_up_E2IH: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs its fast kernel here (else it loops with a host sync)."""
    _, two_inter, hidden = gate_up_E2IH.shape
    return (
        x_TH.is_cuda
        and hasattr(torch, "_grouped_mm")
        and compute_dtype(x_TH) == torch.bfloat16
        and torch.cuda.get_device_capability(x_TH.device)[0] in (9, 10)  # its CUTLASS kernels: sm90, sm100
        and hidden % 8 == 0
        and (two_inter // 2) % 8 == 0
    )


#: ``MoEConfig.experts_impl`` -> whether a gradient-enabled forward takes :func:`grouped_experts`
EXPERTS_IMPLS: dict[str, Callable[[torch.Tensor, torch.Tensor], bool]] = {
    "auto": _bf16_kernel_runs,
    "grouped": lambda x_TH, gate_up_E2IH: True,
    "loop": lambda x_TH, gate_up_E2IH: False,
}


def uses_grouped_experts(experts_impl: str, x_TH: torch.Tensor, gate_up_E2IH: torch.Tensor) -> bool:
    """Whether ``experts_impl`` picks :func:`grouped_experts` for this input."""
    return EXPERTS_IMPLS[experts_impl](x_TH, gate_up_E2IH)


def grouped_experts(
    x_TH: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    gate_up_E2IH: torch.Tensor,
    down_EHI: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    adapters: tuple[StackAdapter | None, StackAdapter | None] = (None, None),
    *,
    biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.0,
) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` in x's dtype, differentiable in x, both weight
    stacks and ``weights_TK``: what ``routed_forward`` with ``Experts.expert_mlp`` computes.
    ``adapters``: LoRA updates of ``(gate_up, down)`` (:class:`StackAdapter`), differentiable too.
    gpt-oss: ``biases`` of ``(gate_up [E, 2I], down [E, H])`` (differentiable) and the clamped
    SwiGLU where ``swiglu_limit`` is set (then ``act`` is unused).

    ``gate_up_E2IH``: ``[E, 2I, H]`` (gate rows first); ``down_EHI``: ``[E, H, I]``;
    ``act``: the gate's activation. Under autocast the GEMMs run in autocast's dtype
    (the weights cast as ``F.linear`` would), the combine in the promoted dtype of the
    expert outputs and the gate weights (float32 for a float32 router).
    """
    num_experts = gate_up_E2IH.shape[0]
    dtype = compute_dtype(x_TH)
    layout = expert_layout(ids_TK, num_experts)
    with torch.autocast(x_TH.device.type, enabled=False):
        x_RH = permute_tokens(x_TH.to(dtype), layout.row_token_R, layout.pair_row_TK)
        gate_up_R2I = _project(x_RH, gate_up_E2IH, adapters[0], layout.offsets_E, dtype)
        gate_RI, up_RI = _add_expert_bias(gate_up_R2I, biases[0], layout.offsets_E).chunk(2, dim=-1)
        hidden_RI = gated_activation(gate_RI, up_RI, act, swiglu_limit, swiglu_alpha)
        out_RH = _project(hidden_RI, down_EHI, adapters[1], layout.offsets_E, dtype)
        out_RH = _add_expert_bias(out_RH, biases[1], layout.offsets_E)
        out_TKH = unpermute_rows(out_RH, layout.pair_row_TK)
        combine_dtype = torch.promote_types(out_TKH.dtype, weights_TK.dtype)
        y_TH = torch.bmm(weights_TK.to(combine_dtype).unsqueeze(1), out_TKH.to(combine_dtype)).squeeze(1)
    return y_TH.to(x_TH.dtype)
