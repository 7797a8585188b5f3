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

from miles_host.kernels.moe_train import permute_tokens, unpermute_rows


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

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Tokens sorted by expert ``[T * top_k, H]``, tokens per expert ``[E]`` (device) and the
        sorted rows' probabilities ``[T * top_k]``."""
        self.hidden_shape_before_permute = hidden_states.shape
        self.local_map = self.routing_map.contiguous()
        num_tokens = self.local_map.shape[0]
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
