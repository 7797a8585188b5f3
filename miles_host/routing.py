"""The routing hook point that MoE layers call.

An MoE layer computes its choice scores, then asks :class:`RoutingHooks` which
experts to use. Without plugins implementing the routing hooks this is a plain
top-k with no hook call at all (so the hot path costs nothing); with them, a
plugin may replace the ids (``miles_select_experts``, e.g. R3 replay) and
observe them (``miles_experts_selected``, e.g. R3 capture in rollout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RoutingContext:
    """What MoE layers of one forward pass need to know about routing.

    ``phase``: ``"rollout"``, ``"train"``, ``"old_logprob"`` or ``"ref"``.
    ``replay_expert_ids``: optional per-layer LongTensor ``[T, K]`` ids to replay
    (filled by a routing plugin). ``captured``: per-layer ids observed in this
    pass (filled by a routing plugin that captures). ``extra``: free-form data.
    """

    phase: str = "train"
    replay_expert_ids: dict[int, torch.Tensor] = field(default_factory=dict)
    captured: dict[int, torch.Tensor] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)



class RoutingHooks:
    """Calls the routing hooks of a plugin manager's hook relay, if any."""

    def __init__(self, hook_relay: Any | None = None):
        self._select = None
        self._observe = None
        if hook_relay is not None:
            if hook_relay.miles_select_experts.get_hookimpls():
                self._select = hook_relay.miles_select_experts
            if hook_relay.miles_experts_selected.get_hookimpls():
                self._observe = hook_relay.miles_experts_selected

    @property
    def active(self) -> bool:
        """True when some plugin implements a routing hook."""
        return self._select is not None or self._observe is not None

    @property
    def replaces_ids(self) -> bool:
        """True when some plugin may replace the router's expert ids (``miles_select_experts``)."""
        return self._select is not None

    def observe(self, layer_index: int, ids_TK: torch.Tensor, routing_context: Any) -> None:
        """Show plugins the ids a layer uses when they came from the router itself (a fused router
        that computed ids and weights together; only where :attr:`replaces_ids` is False)."""
        if self._observe is not None:
            context = routing_context if routing_context is not None else RoutingContext()
            self._observe(layer_index=layer_index, expert_ids=ids_TK, routing_context=context)

    def select(
        self,
        layer_index: int,
        scores_TE: torch.Tensor,
        topk: int,
        routing_context: Any,
        default_ids_TK: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return the ``[T, K]`` expert ids this layer uses.

        ``default_ids_TK`` is the router's own choice when the caller already
        computed it (group-limited routing); otherwise plain top-k of ``scores``.
        """
        if routing_context is None:
            routing_context = RoutingContext()
        context = routing_context
        if default_ids_TK is None:
            default_ids_TK = torch.topk(scores_TE, topk, dim=-1).indices
        ids = None
        if self._select is not None:
            ids = self._select(
                layer_index=layer_index, scores=scores_TE, topk=topk, router_ids=default_ids_TK,
                routing_context=context,
            )
            if ids is not None:
                if ids.shape != (scores_TE.shape[0], topk):
                    raise ValueError(
                        f"routing plugin returned expert ids of shape {tuple(ids.shape)} for "
                        f"MoE layer {layer_index}; expected ({scores_TE.shape[0]}, {topk})"
                    )
                ids = ids.to(device=scores_TE.device, dtype=torch.long)
        if ids is None:
            ids = default_ids_TK
        if self._observe is not None:
            self._observe(layer_index=layer_index, expert_ids=ids, routing_context=context)
        return ids


NO_ROUTING_HOOKS = RoutingHooks(None)
