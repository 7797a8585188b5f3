"""Megatron-Core's token dispatch without host syncs where one rank holds every expert.

With expert- and expert-tensor-parallel sizes 1 a dispatcher communicates nothing: it sorts
the tokens by expert, and after the experts puts their outputs back. Megatron-Core 0.16's
dispatchers still read sizes on the host there, several times per MoE layer and forward
pass: ``MoEAllGatherTokenDispatcher`` copies the tokens per expert to the host and selects
the sorted tokens and probabilities with ``masked_select`` (whose output size the host must
read); ``MoEAlltoAllTokenDispatcher`` copies its split sizes to the host and waits for them
before it sorts (its sync-free path needs TransformerEngine's fused permutation). Each read
drains the GPU's queue mid-forward.

:class:`OneRankTokenDispatcher` is ``MoEAllGatherTokenDispatcher`` (its preprocess,
communication steps and reshapes) with its own sort and unsort:

- the dispatch knows the dropless output size (every token routed to ``top_k`` experts:
  ``tokens * top_k`` rows) and so selects with ``torch.nonzero_static``: the same rows in the
  same order (expert-major, tokens ascending, as ``masked_select`` of the transposed map), the
  same probabilities, the tokens per expert left on the device (the grouped experts read them
  there; ``SequentialMLP``'s loop reads them itself);
- the sort's backward gathers each token's ``top_k`` row gradients and sums them
  (:func:`~miles_host.kernels.moe_train.permute_tokens`), and the combine gathers each
  token's rows and sums them (:func:`~miles_host.kernels.moe_train.unpermute_rows`, whose
  backward copies): no atomics. Megatron's sort backs off through ``index_select``'s backward
  (an atomic ``index_add``) and its combine is a ``scatter_add_`` in the experts' dtype (bf16
  atomics, rounded at every add, in no fixed order); here each token's sum is accumulated in
  float32 and rounded once, in ascending expert order, as the native trainer's combine.

Where the layer's experts are :class:`~miles_megatron.grouped_experts.GroupedSequentialMLP`
and run grouped, the sort goes straight to their padded layout
(:func:`~miles_host.kernels.moe_train.expert_layout` of each token's experts: per expert a
multiple of ``ALIGN_ROWS`` rows, padding rows zero, probability zero) and hands them the
layout in place of the counts, and the combine gathers from those rows: one reordering of
the rows each way instead of two.

:func:`use_one_rank_dispatcher` gives an MoE layer one where it applies (no expert or
expert-tensor parallelism, dropless, no router padding, no fused permutation, no latent
projection, shared experts not overlapped with the dispatch); elsewhere the layer keeps
Megatron's.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoETokenDispatcher

from miles_host.kernels.moe_train import expert_layout, permute_tokens, unpermute_rows
from miles_megatron.grouped_experts import GroupedSequentialMLP


def applies(dispatcher: MoETokenDispatcher) -> bool:
    """Whether :class:`OneRankTokenDispatcher` computes what ``dispatcher`` computes (module doc)."""
    settings = dispatcher.config  # (Megatron's TransformerConfig)
    return (
        dispatcher.ep_size == 1 and dispatcher.tp_size == 1
        and settings.moe_expert_capacity_factor is None
        and not settings.moe_pad_expert_input_to_capacity
        and not settings.moe_router_padding_for_quantization
        and not settings.moe_permute_fusion
        and not getattr(settings, "moe_latent_size", None)
        and not settings.moe_shared_expert_overlap
    )


class OneRankTokenDispatcher(MoEAllGatherTokenDispatcher):
    """``MoEAllGatherTokenDispatcher`` for one rank holding every expert, without host reads
    (module doc)."""

    #: the layer's grouped experts, which take the rows in their padded layout (module doc; None: none)
    grouped_experts: GroupedSequentialMLP | None = None

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Tokens sorted by expert ``[T * top_k, H]``, tokens per expert ``[E]`` (device) and the
        sorted rows' probabilities ``[T * top_k]``; for grouped experts that run grouped, the
        padded layout's rows ``[R, H]``, the layout and the rows' probabilities ``[R]``."""
        self.hidden_shape_before_permute = hidden_states.shape
        self.local_map = self.routing_map.contiguous()
        num_tokens = self.local_map.shape[0]
        if self.grouped_experts is not None and self.grouped_experts.runs_grouped(hidden_states):
            return self._padded_dispatch(hidden_states, probs)
        picked_EtimesT = torch.nonzero_static(self.local_map.T.reshape(-1), size=num_tokens * self.router_topk)
        picked = picked_EtimesT.squeeze(1)
        sorted_tokens = picked % num_tokens
        self.reversed_local_input_permutation_mapping = sorted_tokens
        #: each token's ``top_k`` rows, in ascending expert order ``[T, top_k]``
        self.token_rows = torch.argsort(sorted_tokens, stable=True).view(num_tokens, self.router_topk)
        self.local_probs = probs.T.reshape(-1).index_select(0, picked)
        tokens_per_expert = self.local_map.sum(dim=0).long()
        self.routing_map = None
        rows = permute_tokens(hidden_states, sorted_tokens, self.token_rows, padding_rows=False)
        return rows, tokens_per_expert, self.local_probs

    def _padded_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """The tokens in the grouped experts' padded layout (module doc)."""
        num_tokens, num_experts = self.local_map.shape
        # each token's experts, ascending (the map's row-major set entries)
        picked_TtimesE = torch.nonzero_static(self.local_map.reshape(-1), size=num_tokens * self.router_topk).squeeze(1)
        layout = expert_layout((picked_TtimesE % num_experts).view(num_tokens, self.router_topk), num_experts)
        self.token_rows = layout.pair_row_TK
        pair_probs = probs.reshape(-1).index_select(0, picked_TtimesE)
        self.local_probs = probs.new_zeros(layout.num_rows).index_copy(0, layout.pair_row_TK.reshape(-1), pair_probs)
        self.routing_map = None
        rows = permute_tokens(hidden_states, layout.row_token_R, layout.pair_row_TK)
        return rows, layout, self.local_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The experts' rows ``[T * top_k, H]`` summed back per token ``[T, H]`` (module doc)."""
        return unpermute_rows(hidden_states, self.token_rows).sum(dim=1)


def use_one_rank_dispatcher(moe_layer: Any) -> None:
    """Give ``moe_layer`` (a Megatron ``MoELayer``) a :class:`OneRankTokenDispatcher` in place of
    its dispatcher where that computes the same (:func:`applies`)."""
    old = getattr(moe_layer, "token_dispatcher", None)
    if old is None or isinstance(old, OneRankTokenDispatcher) or not applies(old):
        return
    groups = SimpleNamespace(ep=old.ep_group, expt_tp=old.tp_group, tp_ep=old.tp_ep_group)
    moe_layer.token_dispatcher = OneRankTokenDispatcher(old.num_local_experts, old.local_expert_indices,
                                                        config=old.config, pg_collection=groups)
    if isinstance(moe_layer.experts, GroupedSequentialMLP):
        moe_layer.token_dispatcher.grouped_experts = moe_layer.experts
