"""The grouped-GEMM training experts inside every MoE family: logits against transformers, gradients
against the per-expert loop, activation recomputation and R3 replay (``experts_impl="grouped"`` on CPU)."""

from __future__ import annotations

import pytest
import torch

from miles_host.models import ForwardContext, PackedAttention, RoutingContext, load_pretrained
from miles_host.models.mlp import Experts
from miles_host.routing import RoutingHooks

from .conftest import CASES, family_lookup, hf_logits, prompts_batch
from .test_hf_parity import _packed
from .test_routing import ReplayLastExperts, _relay

MOE_CASES = sorted(case for case, (model_type, _) in CASES.items() if "moe" in model_type or model_type in (
    "deepseek_v3", "minimax_m2"))


def _set_experts_impl(model: torch.nn.Module, impl: str) -> int:
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    for module in experts:
        module.experts_impl = impl
    return len(experts)


def _loss_and_grads(model, batch, ctx=None):
    input_ids_T, positions_T, cu_seqlens, targets_T = batch
    model.zero_grad(set_to_none=True)
    ctx = ctx or ForwardContext(attention=PackedAttention(cu_seqlens))
    log_probs, _ = model.packed_log_probs(input_ids_T, positions_T, cu_seqlens, targets_T, ctx=ctx)
    (log_probs * torch.linspace(-1, 1, log_probs.shape[0])).sum().backward()
    return log_probs.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_every_moe_family_is_covered():
    assert {"qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "minimax_m2"} <= set(MOE_CASES)


@pytest.mark.parametrize("case", MOE_CASES)
def test_grouped_training_forward_matches_transformers_and_loop_gradients(case, checkpoints):
    input_ids, attention_mask = prompts_batch(seed=11)
    reference = hf_logits(checkpoints[case], input_ids, attention_mask)
    model = load_pretrained(checkpoints[case], family=family_lookup)
    assert _set_experts_impl(model, "grouped") > 0
    logits = model(input_ids, attention_mask)  # gradients on: the training path
    assert logits.requires_grad
    valid = attention_mask.bool()
    assert (logits.detach()[valid] - reference[valid]).abs().max().item() <= 1e-4

    batch = _packed(input_ids, attention_mask)
    log_probs, grads = _loss_and_grads(model, batch)
    _set_experts_impl(model, "loop")
    log_probs_loop, grads_loop = _loss_and_grads(model, batch)
    torch.testing.assert_close(log_probs, log_probs_loop, rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_loop.keys()
    assert any(".router." in name for name in grads)  # the router keeps its gradient
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_loop[name], rtol=1e-4, atol=1e-6, msg=name)


def test_grouped_path_under_activation_recomputation(checkpoints):
    model = load_pretrained(checkpoints["qwen3_moe"], family=family_lookup)
    _set_experts_impl(model, "grouped")
    model.train()
    batch = _packed(*prompts_batch(seed=12))
    log_probs, grads = _loss_and_grads(model, batch)
    model.gradient_checkpointing = True
    log_probs_recomputed, grads_recomputed = _loss_and_grads(model, batch)
    torch.testing.assert_close(log_probs_recomputed, log_probs, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_recomputed[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_grouped_path_replays_routes_and_trains_the_router(checkpoints):
    plugin = ReplayLastExperts()
    model = load_pretrained(checkpoints["deepseek_v3"], family=family_lookup, routing_hooks=RoutingHooks(_relay(plugin)))
    _set_experts_impl(model, "grouped")
    batch = _packed(*prompts_batch(seed=13))
    ctx = ForwardContext(attention=PackedAttention(batch[2]), routing=RoutingContext(phase="train"))
    _, grads = _loss_and_grads(model, batch, ctx)
    topk, num_experts = model.config.moe.top_k, model.config.moe.num_experts
    for i, is_moe in enumerate(model.config.moe_layers):
        if not is_moe:
            continue
        assert grads[f"layers.{i}.mlp.router.weight"].abs().sum() > 0
        expert_grad = grads[f"layers.{i}.mlp.experts.gate_up_proj"]
        assert expert_grad[: num_experts - topk].abs().sum() == 0
        assert expert_grad[num_experts - topk :].abs().sum() > 0
