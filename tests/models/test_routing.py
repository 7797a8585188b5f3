"""MoE layers route through the routing hooks: plugins can replace and observe expert ids."""

from __future__ import annotations

import pluggy
import torch

from miles_host import hookspecs
from miles_host.hookspecs import hookimpl
from miles_host.models import ForwardContext, PackedAttention, RoutingContext, load_pretrained
from miles_host.routing import RoutingHooks

from .conftest import family_lookup, prompts_batch
from .test_hf_parity import _packed


class ReplayLastExperts:
    """Routes every token to the last ``topk`` experts and records what layers used."""

    def __init__(self):
        self.selected: dict[int, torch.Tensor] = {}
        self.scores_seen: list[int] = []

    @hookimpl
    def miles_select_experts(self, layer_index, scores, topk, routing_context):
        self.scores_seen.append(layer_index)
        num_experts = scores.shape[1]
        ids = torch.arange(num_experts - topk, num_experts)
        return ids.expand(scores.shape[0], topk)

    @hookimpl
    def miles_experts_selected(self, layer_index, expert_ids, routing_context):
        self.selected[layer_index] = expert_ids
        routing_context.captured[layer_index] = expert_ids


def _relay(plugin):
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    manager.register(plugin)
    return manager.hook


def test_replaced_ids_change_output_and_router_still_gets_gradients(checkpoints):
    input_ids, attention_mask = prompts_batch(seed=5)
    input_ids_T, positions_T, cu_seqlens, targets_T = _packed(input_ids, attention_mask)
    plain = load_pretrained(checkpoints["deepseek_v3"], family=family_lookup)
    plugin = ReplayLastExperts()
    hooked = load_pretrained(checkpoints["deepseek_v3"], family=family_lookup, routing_hooks=RoutingHooks(_relay(plugin)))
    assert RoutingHooks(_relay(plugin)).active

    with torch.no_grad():
        baseline, _ = plain.packed_log_probs(input_ids_T, positions_T, cu_seqlens, targets_T)
    routing = RoutingContext(phase="train")
    ctx = ForwardContext(attention=PackedAttention(cu_seqlens), routing=routing)
    log_probs, _ = hooked.packed_log_probs(input_ids_T, positions_T, cu_seqlens, targets_T, ctx=ctx)
    assert (log_probs - baseline).abs().max() > 1e-3

    moe_layers = [i for i, is_moe in enumerate(hooked.config.moe_layers) if is_moe]
    assert sorted(plugin.selected) == moe_layers == sorted(routing.captured)
    topk, num_experts = hooked.config.moe.top_k, hooked.config.moe.num_experts
    for ids in plugin.selected.values():
        assert ids.shape == (input_ids_T.shape[0], topk)
        assert set(ids.unique().tolist()) == set(range(num_experts - topk, num_experts))

    log_probs.sum().backward()
    for i in moe_layers:
        router_grad = hooked.layers[i].mlp.router.weight.grad
        assert router_grad is not None and router_grad.abs().sum() > 0
        # only the replayed experts were used, so only they get expert gradients
        expert_grad = hooked.layers[i].mlp.experts.gate_up_proj.grad
        assert expert_grad[: num_experts - topk].abs().sum() == 0
        assert expert_grad[num_experts - topk :].abs().sum() > 0


def test_hook_returning_none_keeps_router_choice(checkpoints):
    class Observer:
        @hookimpl
        def miles_select_experts(self, layer_index, scores, topk, routing_context):
            return None

    input_ids, attention_mask = prompts_batch(seed=6)
    plain = load_pretrained(checkpoints["qwen3_moe"], family=family_lookup)
    hooked = load_pretrained(checkpoints["qwen3_moe"], family=family_lookup, routing_hooks=RoutingHooks(_relay(Observer())))
    with torch.no_grad():
        torch.testing.assert_close(hooked(input_ids, attention_mask), plain(input_ids, attention_mask))
