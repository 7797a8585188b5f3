"""The host's MoE routing (R3/R2 replay, route observers) through Megatron-Core's
``RouterReplay`` (``moe_enable_routing_replay``).

A forward pre-hook on every MoE layer's ``TopKRouter`` decides the ids that layer
uses, the way the native MoE layer does (:class:`miles_host.routing.RoutingHooks`):

- the router's own top-k is computed from the router input (no gradient) as the native
  router takes it (:meth:`miles_host.models.mlp.Router.default_choice`: softmax or sigmoid
  scores, plus the expert bias, group-limited for DeepSeek), which is Megatron's own choice;
- with routing plugins (``miles_select_experts`` / ``miles_experts_selected``, e.g.
  miles-r3) they choose and observe the ids, in packed token order;
- without them, ``RoutingContext.replay_expert_ids[layer]`` is replayed, rows of -1
  keeping the router's own choice;

and the ids, reordered to Megatron's token order (padding rows keep the router's
choice), become the layer's ``RouterReplay`` target (``REPLAY_FORWARD``). Where Megatron's
group-limited top-k differs from the model's
(:func:`~miles_megatron.moe_routing.megatron_group_rule_differs`), every forward replays
the native choice that way, routing plugins or not. Megatron
then gathers the router's scores at those ids, so the router keeps its gradient.
Dense layers have no router and are never touched. A recomputation in backward
(``--recompute-granularity full``) replays the ids its forward used: during a training
step (:meth:`RouterReplayBridge.keep_for_recompute`) each forward's target is queued
too, and a router run inside a backward pass takes the oldest queued one
(``REPLAY_BACKWARD``; Megatron's 1F1B runs the backwards in forward order).

Under sequence parallelism a router sees this TP rank's positions: the hook routes the
whole sequence (its input all-gathered over TP, no gradient) and keeps this rank's rows,
so the plugins see every packed token, as without it.

Under autocast (the trainer on GPU) the same pre-hook hands the router its input in
the autocast dtype: Megatron's router GEMM (``RouterGatingLinearFunction``) is an
autograd Function without ``custom_fwd``/``custom_bwd``, so a float32 input gives
bf16 logits (autocast) and a backward that multiplies those bf16 gradients by the
float32 weight outside autocast, which fails. In bf16 it is the GEMM the native
router runs under autocast (bf16 operands, bf16 logits).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from miles_megatron.moe_routing import megatron_group_rule_differs


def moe_routers(gpt: torch.nn.Module | list[torch.nn.Module]) -> dict[int, torch.nn.Module]:
    """``{layer index (0-based): TopKRouter}`` of the MoE layers of a GPTModel (or of a rank's
    model chunks under virtual pipeline stages)."""
    routers = {}
    for chunk in gpt if isinstance(gpt, (list, tuple)) else [gpt]:
        for layer in chunk.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                routers[layer.layer_number - 1] = router
    return routers


class RouterReplayBridge:
    """Installs the pre-hooks; :meth:`set_forward` gives them each forward's routing."""

    def __init__(self, gpt: torch.nn.Module | list[torch.nn.Module], routing_hooks: Any, moe: Any):
        """``moe``: the native :class:`~miles_host.models.config.MoEConfig` (None: a dense model)."""
        from miles_host.models.mlp import Router

        self.routing_hooks = routing_hooks
        self.moe = moe
        self.top_k = moe.top_k if moe is not None else 0
        #: Megatron's group-limited top-k is not the model's: every forward replays the native choice
        self.native_choice = moe is not None and megatron_group_rule_differs(moe)
        if moe is not None:
            with torch.device("meta"):  # only its choice rule is used (no weight)
                self.choice_rule = Router(1, moe)
        self.routers = moe_routers(gpt)
        self.routing = None
        self.layout = None
        #: queue each forward's ids for its recomputation in backward (a training step with recomputation)
        self.queue_for_recompute = False
        from megatron.core.transformer.moe.router_replay import RouterReplay

        instances = RouterReplay.global_router_replay_instances
        for layer_index, router in self.routers.items():
            if router.router_replay is None:
                raise ValueError("the megatron backend builds MoE layers with moe_enable_routing_replay=True")
            router.register_forward_pre_hook(self._pre_hook(layer_index))
            # driven per router here, never through Megatron's process-wide list: leave it
            # (a reference model or a second trainer would otherwise pile up there)
            if router.router_replay in instances:
                instances.remove(router.router_replay)

    def keep_for_recompute(self, on: bool) -> None:
        """Queue (``on``) each forward's ids for the recomputation in backward; off: the
        queues are dropped."""
        self.queue_for_recompute = on
        if not on:
            for router in self.routers.values():
                router.router_replay.replay_backward_list = []

    def set_forward(self, routing: Any, layout: Any) -> None:
        """The routing context and token layout of the forward about to run."""
        self.routing = routing
        self.layout = layout

    def _pre_hook(self, layer_index: int):
        def hook(router, args):
            hidden_SBH = args[0]
            device_type = hidden_SBH.device.type
            if torch.is_autocast_enabled(device_type):
                hidden_SBH = hidden_SBH.to(torch.get_autocast_dtype(device_type))
            self._route(layer_index, router, hidden_SBH)
            return (hidden_SBH, *args[1:])

        return hook

    def _route(self, layer_index: int, router: torch.nn.Module, hidden_SBH: torch.Tensor) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        replay = router.router_replay
        if torch._C._current_graph_task_id() != -1:  # recomputation in backward: its forward's ids, if queued
            if replay.replay_backward_list:
                replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            else:
                replay.clear_router_replay_action()
            return
        routing, layout = self.routing, self.layout
        wanted = routing is not None and (
            self.routing_hooks.active or routing.replay_expert_ids.get(layer_index) is not None
        )
        if not wanted and not self.native_choice:
            replay.target_topk_idx = None
            replay.clear_router_replay_action()  # Megatron's own top-k
            return
        with torch.no_grad():
            sharded = router.config.sequence_parallel
            if sharded:  # this rank's positions: route the whole sequence, keep this rank's rows below
                from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

                hidden_SBH = gather_from_sequence_parallel_region(hidden_SBH, tensor_parallel_output_grad=False)
            # the router's GEMM (in the input's dtype, bf16 under autocast), float32 scores: the
            # native router's choice scores, and the top-k Megatron itself would take
            weight = router.weight.to(hidden_SBH.dtype)
            logits_NE = F.linear(hidden_SBH.reshape(-1, hidden_SBH.shape[-1]), weight)
            scores_NE = choice_scores(logits_NE, self.moe.score_func, router.expert_bias)
            own_NK = self.choice_rule.default_choice(scores_NE)
            target_NK = own_NK
            if wanted:
                rows_T = layout.megatron_row_T
                own_TK = own_NK[rows_T]
                if self.routing_hooks.active:
                    ids_TK = self.routing_hooks.select(
                        layer_index, scores_NE[rows_T], self.top_k, routing, default_ids_TK=own_TK
                    )
                else:
                    recorded_TK = routing.replay_expert_ids[layer_index].to(own_TK.device)
                    ids_TK = torch.where(recorded_TK[:, :1] >= 0, recorded_TK, own_TK)
                target_NK = own_NK.clone()
                target_NK[rows_T] = ids_TK.to(own_NK.dtype)
            if sharded:  # rows are position-major: this TP rank's sequence shard is one chunk
                target_NK = _sequence_shard(target_NK)
        replay.target_topk_idx = target_NK
        if self.queue_for_recompute:
            replay.replay_backward_list.append(target_NK)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


#: the native router's score functions (float32)
SCORES = {
    "softmax": lambda logits: torch.softmax(logits.float(), dim=-1),
    "sigmoid": lambda logits: torch.sigmoid(logits.float()),
}


def choice_scores(logits_NE: torch.Tensor, score_func: str, expert_bias: torch.Tensor | None) -> torch.Tensor:
    """The scores the experts are chosen on: the score function's, plus the expert bias if any."""
    scores_NE = SCORES[score_func](logits_NE)
    return scores_NE if expert_bias is None else scores_NE + expert_bias.float()


def _sequence_shard(rows_N: torch.Tensor) -> torch.Tensor:
    """This TP rank's rows of position-major ``[S * B, ...]`` values (sequence parallelism)."""
    from megatron.core import parallel_state as ps

    return rows_N.chunk(ps.get_tensor_model_parallel_world_size())[ps.get_tensor_model_parallel_rank()]
