"""Megatron-Core's routed experts as grouped GEMMs, on ``SequentialMLP``'s parameters.

The local layer spec builds the experts as ``SequentialMLP``: per forward a host read of
the token counts, then for each local expert its own ``linear_fc1``, activation and
``linear_fc2`` (two small GEMMs per expert, launched from Python). Megatron's grouped
alternatives do not run here: ``GroupedMLP`` needs the external ``grouped_gemm`` CUDA
package and bf16 *parameters* (``TransformerConfig.bf16``; this backend keeps float32 masters under
a bf16 autocast forward: :mod:`miles_megatron.policy`), ``TEGroupedMLP`` needs
TransformerEngine.

:class:`GroupedSequentialMLP` is ``SequentialMLP`` (same constructor, parameters
``local_experts.{e}.linear_fc{1,2}.weight``, sharded state dict), so the weight maps,
EP sharding, checkpoints, R3, weight sync and the optimizers see what they saw. Its
forward computes every local expert at once with the native trainer's grouped-GEMM
pieces (:mod:`miles_host.kernels.moe_train`):

1. the dispatcher's rows (grouped by expert, ``tokens_per_expert`` each) placed in
   :func:`~miles_host.kernels.moe_train.expert_layout`'s padded layout (each group a
   multiple of ``ALIGN_ROWS`` rows, as ``torch._grouped_mm`` wants; padding rows zero);
2. the experts' weights stacked in the compute dtype (autocast's where it is on, as
   ``F.linear`` under autocast casts each expert's weight), ``grouped_mm`` for fc1;
3. Megatron's activation (GLU: ``act(gate) * (up + glu_linear_offset)``, gate rows
   first, clamped where ``activation_func_clamp_value`` is set), times each row's routing
   probability (in the promoted dtype, rounded back, as ``MLP`` applies ``per_token_scale``);
4. ``grouped_mm`` for fc2, the rows put back in the dispatcher's order (a gather whose
   backward copies: :func:`~miles_host.kernels.moe_train.unpermute_rows`).

Where the layer's dispatcher is :class:`~miles_megatron.dispatcher.OneRankTokenDispatcher`, it
sorts the tokens straight into the padded layout and hands the experts that
:class:`~miles_host.kernels.moe_train.ExpertLayout` in place of the token counts: steps 1 and
4's reorderings (and their backward) are skipped, and its combine reads the padded rows
(:meth:`GroupedSequentialMLP.padded_forward`; the same rows in the same places, so the same
result bit for bit).

In Megatron's DDP without ``--overlap-grad-reduce`` (:func:`miles_megatron.schedule.wrap_ddp`
sets :attr:`GroupedSequentialMLP.weight_grads_into_main_grad`), the stacks' backward adds each
expert's weight gradient straight into its ``main_grad`` (the DDP's float32 gradient buffer),
with one ``add_`` per projection where the experts' ``main_grad`` lie evenly spaced in the
buffer (Megatron's layout: every expert's two weights, in reverse order; :func:`evenly_spaced`),
else one ``_foreach_add_`` (:class:`StackedExpertWeights`): the same sums
the DDP's per-parameter hook makes, without an ``AccumulateGrad`` and a Python hook call
for each expert's two linears in every backward pass (~1,100 parameter tensors in the MoE
bench shape: the hooks cost the backward more host time than its kernels leave). With the
overlapped reduction the DDP counts each parameter's hook, so the gradients take that path.

Inside :func:`expert_stacks_reused` (one optimizer step's forward and backward passes and the
log-prob passes, without activation recomputation: the weights do not change there) each
projection's stacked, cast weights are built once and every micro-batch's forward reads them
(one stack and cast per pass instead of one per micro-batch; without recomputation the
training backward holds every layer's stacks at once anyway, so the peak stays).

Which forward runs is the model's ``MoEConfig.experts_impl``, the native trainer's record
(:data:`~miles_host.kernels.moe_train.EXPERTS_IMPLS`): ``auto`` groups where
``_grouped_mm`` runs its bf16 kernel (CUDA sm90/sm100 under bf16) and keeps
``SequentialMLP``'s loop elsewhere (the CPU), ``grouped`` always groups, ``loop`` never.
What the grouped forward does not compute keeps the loop too (:func:`grouped_forward_covers`):
expert biases, expert tensor parallelism, probabilities applied on the input, FP8/FP4
padding, fused or TransformerEngine activations, weight gradients delayed to ``backward_dw``,
and expert linears whose GEMMs
``--plugins fp8`` replaced (:mod:`miles_megatron.fp8`).

Megatron's ``--moe-grouped-gemm`` stays off in ``TransformerConfig`` (it would build
``GroupedMLP``); :func:`with_grouped_experts` puts this class in the layer spec instead.

Tensor legend: N dispatched rows, R rows of the padded layout, E local experts,
H hidden, F fc1 outputs (2I for GLU), I expert intermediate.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from miles_host.kernels.moe_train import (
    ExpertLayout,
    compute_dtype,
    expert_layout,
    grouped_mm,
    unpermute_rows,
    uses_grouped_experts,
)
from miles_megatron.mla_spec import rewrite_spec


def grouped_forward_covers(config: Any, expert_tp: int) -> bool:
    """Whether :class:`GroupedSequentialMLP`'s grouped forward computes what ``SequentialMLP``
    computes under ``config`` (a ``TransformerConfig``) with expert TP size ``expert_tp``."""
    return (
        expert_tp == 1
        and not config.add_bias_linear
        and not config.moe_apply_probs_on_input
        and not (config.fp8 or getattr(config, "fp4", None))
        and not config.use_te_activation_func
        and not config.bias_activation_fusion
        and not getattr(config, "delay_wgrad_compute", False)
    )


class GroupedSequentialMLP(SequentialMLP):
    """``SequentialMLP`` whose forward runs all local experts as two grouped GEMMs (module doc)."""

    def __init__(self, num_local_experts: int, config: Any, submodules: Any, pg_collection: Any = None,
                 experts_impl: str = "auto"):
        super().__init__(num_local_experts, config, submodules, pg_collection)
        #: ``MoEConfig.experts_impl``: which forward runs (module doc)
        self.experts_impl = experts_impl
        self.covered = grouped_forward_covers(self.config, self.tp_group.size())
        #: the grouped forward's weight gradients go straight into the DDP's ``main_grad`` (module doc)
        self.weight_grads_into_main_grad = False
        #: per projection (its first weight's id): the main_grads' buffer address and their one view
        self._main_grad_views: dict[int, tuple[tuple[int, int], GradsView | None]] = {}

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """``SequentialMLP.forward``: ``(output [N, H], None)``, grouped where the experts impl says so."""
        x_NH = permuted_local_hidden_states
        if isinstance(tokens_per_expert, ExpertLayout):  # rows already in the padded layout (module doc)
            return self.padded_forward(x_NH, tokens_per_expert, permuted_probs), None
        if not self.runs_grouped(x_NH):
            return super().forward(x_NH, tokens_per_expert, permuted_probs)
        return self.grouped_forward(x_NH, tokens_per_expert, permuted_probs), None

    def runs_grouped(self, x_NH: torch.Tensor) -> bool:
        """Whether the forward of rows like ``x_NH`` is the grouped one (else ``SequentialMLP``'s loop)."""
        fc1_1FH = self.local_experts[0].linear_fc1.weight.unsqueeze(0)  # the shape the impl check reads
        return self.covered and not self.linears_replaced() and uses_grouped_experts(self.experts_impl, x_NH, fc1_1FH)

    def linears_replaced(self) -> bool:
        """Whether an expert linear computes through its own ``_forward_impl`` (``--plugins fp8``:
        :func:`miles_megatron.fp8.apply_fp8`), which only the per-expert loop calls."""
        return any("_forward_impl" in vars(expert.linear_fc1) or "_forward_impl" in vars(expert.linear_fc2)
                   for expert in self.local_experts)

    def grouped_forward(self, x_NH: torch.Tensor, tokens_per_expert: torch.Tensor,
                        probs_N: torch.Tensor) -> torch.Tensor:
        """The experts' output ``[N, H]`` in the compute dtype; no host sync on the counts."""
        num_rows, num_experts = x_NH.shape[0], self.num_local_experts
        device = x_NH.device
        expert_N = torch.repeat_interleave(torch.arange(num_experts, device=device), tokens_per_expert.to(device),
                                           output_size=num_rows)
        layout = expert_layout(expert_N.unsqueeze(1), num_experts)
        row_N = layout.pair_row_TK.squeeze(1)  # each dispatched row's row in the padded layout
        dtype = compute_dtype(x_NH)
        with torch.autocast(device.type, enabled=False):
            x_RH = _padded(x_NH.to(dtype), row_N, layout.num_rows)
            probs_R = _padded(probs_N.unsqueeze(1), row_N, layout.num_rows).squeeze(1)
        out_RH = self.padded_forward(x_RH, layout, probs_R)
        return unpermute_rows(out_RH, row_N.unsqueeze(1)).squeeze(1)  # (backward: a copy, no atomics)

    def padded_forward(self, x_RH: torch.Tensor, layout: ExpertLayout, probs_R: torch.Tensor) -> torch.Tensor:
        """The experts' output ``[R, H]`` in the compute dtype for rows already in ``layout``'s
        padded order (padding rows zero, their probability zero)."""
        dtype = compute_dtype(x_RH)
        # one stack and one cast per projection (backward: one cast, then each expert's slice of it)
        fc1_EFH = self.stacked([expert.linear_fc1.weight for expert in self.local_experts], dtype)
        fc2_EHI = self.stacked([expert.linear_fc2.weight for expert in self.local_experts], dtype)
        with torch.autocast(x_RH.device.type, enabled=False):
            hidden_RI = self.activation(grouped_mm(x_RH.to(dtype), fc1_EFH.transpose(1, 2), layout.offsets_E))
            hidden_RI = (hidden_RI * probs_R.unsqueeze(1)).to(dtype)
            return grouped_mm(hidden_RI, fc2_EHI.transpose(1, 2), layout.offsets_E)

    def stacked(self, weights: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The experts' weights ``[E, ...]`` in ``dtype``; gradients into ``main_grad`` where
        :attr:`weight_grads_into_main_grad` holds and every weight trains in the DDP's buffer;
        built once per :func:`expert_stacks_reused` scope where gradients take that path or
        none is taken."""
        grad = torch.is_grad_enabled()
        direct = self.weight_grads_into_main_grad and grad and all(
            weight.requires_grad and getattr(weight, "main_grad", None) is not None for weight in weights)
        stack = None
        if _REUSED_STACKS is not None and (direct or not grad):
            key = (id(weights[0]), dtype)
            stack = _REUSED_STACKS.get(key)
            if stack is None:
                with torch.no_grad():
                    stack = _REUSED_STACKS[key] = torch.stack(weights).to(dtype)
            if not grad:
                return stack
        if direct:
            return StackedExpertWeights.apply(_ANCHOR, dtype, weights, self.main_grads_view(weights), stack)
        return torch.stack(weights).to(dtype)

    def main_grads_view(self, weights: list[torch.Tensor]) -> GradsView | None:
        """The weights' ``main_grad`` as one view (:func:`evenly_spaced`), found once per buffer."""
        where = (weights[0].main_grad.data_ptr(), weights[-1].main_grad.data_ptr())
        cached = self._main_grad_views.get(id(weights[0]))
        if cached is None or cached[0] != where:
            cached = self._main_grad_views[id(weights[0])] = (where, evenly_spaced([w.main_grad for w in weights]))
        return cached[1]

    def activation(self, fc1_RF: torch.Tensor) -> torch.Tensor:
        """Megatron ``MLP``'s unfused activation of the fc1 output (GLU: gate rows first)."""
        config = self.config
        if not config.gated_linear_unit:
            return config.activation_func(fc1_RF)
        gate_RI, up_RI = torch.chunk(fc1_RF, 2, dim=-1)
        if (limit := config.activation_func_clamp_value) is not None:
            gate_RI, up_RI = gate_RI.clamp(max=limit), up_RI.clamp(min=-limit, max=limit)
        return config.activation_func(gate_RI) * (up_RI + config.glu_linear_offset)


#: the one input of :class:`StackedExpertWeights` autograd sees (its output must require grad)
_ANCHOR = torch.empty(0, requires_grad=True)


@dataclass(frozen=True)
class GradsView:
    """Equally shaped tensors at evenly spaced places of one storage as one strided view
    ``[E, ...]``: ``view[e]`` is tensor ``e``, or tensor ``E - 1 - e`` where ``reversed``."""

    view: torch.Tensor
    reversed: bool

    def add_(self, values_E: torch.Tensor) -> None:
        """Add ``values_E[e]`` to tensor ``e``, each promoted to the tensors' dtype (one kernel,
        and a copy of ``values_E`` flipped where the layout is reversed)."""
        self.view.add_(values_E.flip(0) if self.reversed else values_E)


def evenly_spaced(tensors: list[torch.Tensor]) -> GradsView | None:
    """``tensors`` as one :class:`GradsView` where they are contiguous, of one shape and dtype,
    in one storage at a constant spacing (in order or reversed) without overlap; else None."""
    first = tensors[0]
    if len(tensors) < 2 or not all(
            t.is_contiguous() and t.shape == first.shape and t.dtype == first.dtype
            and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for t in tensors):
        return None
    offsets = [t.storage_offset() for t in tensors]
    step = offsets[1] - offsets[0]
    if abs(step) < first.numel() or any(b - a != step for a, b in zip(offsets, offsets[1:])):
        return None
    view = first.as_strided((len(tensors), *first.shape), (abs(step), *first.stride()), min(offsets))
    return GradsView(view, step < 0)


class StackedExpertWeights(torch.autograd.Function):
    """``torch.stack(weights).to(dtype)`` whose backward adds each weight's gradient (in the
    weights' dtype, as the cast's backward gives it) to the weight's ``main_grad`` (module doc):
    through ``grads_view`` (:func:`evenly_spaced` of the main_grads) in one ``add_`` where there
    is one, else one ``_foreach_add_``. The weights come as one list, which autograd does not
    see: no ``AccumulateGrad`` of theirs runs, so no hook of the DDP's either; ``anchor``
    (:data:`_ANCHOR`) makes the output require grad."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, dtype: torch.dtype, weights: list[torch.Tensor],
                grads_view: GradsView | None, stack: torch.Tensor | None = None) -> torch.Tensor:
        """``stack``: the stacked, cast weights already built (:func:`expert_stacks_reused`)."""
        ctx.weights, ctx.grads_view = weights, grads_view
        return stack.view_as(stack) if stack is not None else torch.stack(weights).to(dtype)

    @staticmethod
    def backward(ctx: Any, grad_E: torch.Tensor) -> tuple[None, ...]:
        if ctx.grads_view is not None and ctx.weights[0].dtype == ctx.grads_view.view.dtype:
            ctx.grads_view.add_(grad_E)  # (bf16 -> float32 in the add: the cast's backward, exactly)
            return None, None, None, None, None
        main_grads = [weight.main_grad for weight in ctx.weights]
        grads = grad_E.to(ctx.weights[0].dtype).to(main_grads[0].dtype).unbind(0)
        torch._foreach_add_(main_grads, list(grads))
        return None, None, None, None, None


#: the stacks built in the current :func:`expert_stacks_reused` scope (None: outside one)
_REUSED_STACKS: dict[tuple[int, torch.dtype], torch.Tensor] | None = None


@contextlib.contextmanager
def expert_stacks_reused(enabled: bool = True) -> Iterator[None]:
    """While the experts' weights stay unchanged (one step's passes): each projection's stacked,
    cast weights built once and reused (module doc). Nested scopes share the outer one's."""
    global _REUSED_STACKS
    outer = _REUSED_STACKS
    if enabled and outer is None:
        _REUSED_STACKS = {}
    try:
        yield
    finally:
        _REUSED_STACKS = outer


def _padded(x_NC: torch.Tensor, row_N: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``x``'s rows at rows ``row_N`` of a zero ``[R, C]`` (padding rows stay zero); the backward
    gathers the gradient rows back (no atomics)."""
    return x_NC.new_zeros(num_rows, x_NC.shape[1]).index_copy(0, row_N, x_NC)


def with_grouped_experts(spec: Any, experts_impl: str) -> Any:
    """A copy of a decoder block spec whose ``SequentialMLP`` experts are
    :class:`GroupedSequentialMLP` running ``experts_impl`` (``MoEConfig.experts_impl``)."""

    def changed(node: Any) -> bool:
        if getattr(node, "module", None) is not SequentialMLP:
            return False
        node.module = GroupedSequentialMLP
        node.params = {**node.params, "experts_impl": experts_impl}
        return True

    return rewrite_spec(spec, changed)
