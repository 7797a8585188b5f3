"""CPU tests of the fused MoE router (:mod:`miles_host.kernels.moe_router`) under Triton's interpreter
(not collected by itself).

Run by ``test_moe_router.py::test_router_kernel_under_the_triton_interpreter`` in a fresh
process with ``TRITON_INTERPRET=1``. The kernel's ids, weights and row layout against
:func:`router_reference` (float64, stable sorts) and :func:`route` (torch ops) for every
routing variant; the MoE block's fused-router path against its eager router.
"""

from __future__ import annotations

import pytest
import torch

from miles_host.models.config import MoEConfig
from miles_host.models.mlp import MoE, uses_fused_router
from miles_host.routing import RoutingHooks
from tests.kernels.test_moe_router import VARIANTS, make_logits, spec_of
from tests.plugins.triton_interpret import interpreted_module


@pytest.fixture(scope="module")
def router():
    return interpreted_module("miles_host.kernels.moe_router")


@pytest.fixture(scope="module")
def grouped():
    return interpreted_module("miles_host.kernels.moe_grouped")


def check_against_reference(router, grouped, spec, logits, bias, block_m=16, weights_dtype=torch.float32):
    """ids equal, weights within one rounding of ``weights_dtype``, layout = ``route``'s."""
    ids, routing = router.fused_route(logits, spec, bias, block_m, weights_dtype)
    expected_ids, expected_weights = router.router_reference(logits, spec, bias)
    assert ids.dtype == torch.long and torch.equal(ids, expected_ids)
    assert routing.weights_TK.dtype == weights_dtype
    tol = {torch.float32: 2e-6, torch.bfloat16: 8e-3}[weights_dtype]
    torch.testing.assert_close(routing.weights_TK.double(), expected_weights, rtol=tol, atol=tol)
    expected = grouped.route(expected_ids, routing.weights_TK, spec.num_experts, block_m)
    for name in ("row_token_R", "block_expert_B", "pair_row_TK", "weights_TK"):
        assert torch.equal(getattr(routing, name), getattr(expected, name)), name
    assert routing.block_m == block_m


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("num_tokens", [1, 3, 20])  # batch 1; odd; more tokens than experts (E=16)
def test_kernel_matches_the_float64_reference(router, grouped, variant, num_tokens):
    spec, bias = spec_of(variant)
    check_against_reference(router, grouped, spec, make_logits(num_tokens, spec.num_experts, seed=num_tokens), bias)


@pytest.mark.parametrize("variant", ["softmax_norm", "sigmoid_group_bias_scaled"])
def test_ties_go_to_the_lower_expert(router, grouped, variant):
    """Integer logits: many equal scores, equal group sums; the lower index wins as in the reference."""
    spec, bias = spec_of(variant)
    logits = torch.randint(-2, 2, (20, spec.num_experts), generator=torch.Generator().manual_seed(5)).float()
    check_against_reference(router, grouped, spec, logits, None if bias is None else torch.zeros_like(bias))
    check_against_reference(router, grouped, spec, torch.zeros(3, spec.num_experts), None)  # all equal


@pytest.mark.parametrize("num_tokens", [1, 3, 64])
def test_qwen3_router_shape_bf16_logits(router, grouped, num_tokens):
    """E=128, K=8, softmax + norm_topk_prob, bf16 logits and weights (a bf16 router), row block 16 and 32."""
    spec = router.RouterSpec(num_experts=128, top_k=8)
    logits = make_logits(num_tokens, 128, seed=7).bfloat16()
    for block_m in (16, 32):
        check_against_reference(router, grouped, spec, logits, None, block_m, torch.bfloat16)


def test_deepseek_v3_router_shape(router, grouped):
    """E=256 in 8 groups (top-4 groups), K=8, sigmoid + bias, scaling 2.5, fp32 logits."""
    spec = router.RouterSpec(256, 8, "sigmoid", 8, 4, True, 1e-20, 2.5)
    bias = torch.randn(256, generator=torch.Generator().manual_seed(2)) * 0.05
    check_against_reference(router, grouped, spec, make_logits(5, 256, seed=3), bias)


def test_strided_logits_and_top_k_not_a_power_of_two(router, grouped):
    spec = router.RouterSpec(num_experts=12, top_k=3, norm_topk_prob=False)
    logits = make_logits(6, 24, seed=9)[:, ::2]
    check_against_reference(router, grouped, spec, logits, None)


@pytest.mark.parametrize("fields", [
    dict(num_experts=8, top_k=1, score_func="sigmoid", norm_topk_prob=False),  # top-1 (one slot, padded to two)
    dict(num_experts=12, top_k=3, score_func="sigmoid", n_group=3, topk_group=2),  # a padding group in the tile
    dict(num_experts=160, top_k=8, score_func="sigmoid", routed_scaling_factor=2.5),  # GLM-4.5's 160 experts
    dict(num_experts=10, top_k=10),  # every expert chosen
])
def test_other_expert_counts(router, grouped, fields):
    spec = router.RouterSpec(**fields)
    bias = torch.randn(spec.num_experts, generator=torch.Generator().manual_seed(6)) * 0.1
    for num_tokens in (1, 7):
        logits = make_logits(num_tokens, spec.num_experts, seed=num_tokens)
        check_against_reference(router, grouped, spec, logits, None)
        check_against_reference(router, grouped, spec, logits, bias)


def test_refuses_what_it_does_not_support(router):
    spec = router.RouterSpec(num_experts=16, top_k=2)
    with pytest.raises(ValueError, match="supports"):
        router.fused_route(torch.zeros(router.MAX_TOKENS + 1, 16), spec, None, 16, torch.float32)
    with pytest.raises(ValueError, match="experts"):
        router.fused_route(torch.zeros(2, 8), spec, None, 16, torch.float32)


class _Observer:
    """A routing plugin's relay that only observes (R3 capture): the fused router stays on."""

    def __init__(self, replace: bool = False):
        self.seen = []
        observer = self

        class Hook:
            def __init__(self, impl):
                self.impl = impl

            def get_hookimpls(self):
                return [self.impl] if self.impl else []

            def __call__(self, **kwargs):
                return self.impl(**kwargs)

        self.miles_experts_selected = Hook(lambda layer_index, expert_ids, routing_context:
                                           observer.seen.append(expert_ids.clone()))
        self.miles_select_experts = Hook((lambda **kwargs: None) if replace else None)


def _moe(variant, dtype, hooks=None):
    from tests.kernels.test_moe_router import MOE_VARIANTS

    torch.manual_seed(0)
    block = MoE(32, MoEConfig(num_experts=16, intermediate_size=16, **MOE_VARIANTS[variant]), "silu", 0,
                hooks or RoutingHooks(None))
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape) / param.shape[-1] ** 0.5)
        if block.router.expert_bias is not None:
            block.router.expert_bias.copy_(torch.randn(16) * 0.1)
    return block.to(dtype).eval()


@pytest.mark.parametrize("variant", ["qwen3", "deepseek_v3", "glm45_shared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_block_fused_router_matches_the_eager_router(router, variant, dtype):
    block = _moe(variant, dtype)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        assert uses_fused_router(block, x)
        fused = block(x)
        block.router_kernel = "torch"
        assert not uses_fused_router(block, x)
        eager = block(x)
    assert fused.dtype == dtype
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(fused.double(), eager.double(), rtol=tol, atol=tol * eager.abs().max().item())


def test_observing_plugins_see_the_ids_and_replacing_ones_turn_the_fused_router_off(router):
    observer = _Observer()
    block = _moe("qwen3", torch.float32, RoutingHooks(observer))
    x = torch.randn(4, 32)
    with torch.no_grad():
        assert uses_fused_router(block, x)
        block(x)
        block.router_kernel = "torch"
        block(x)
    fused_ids, eager_ids = observer.seen
    assert torch.equal(fused_ids, eager_ids.sort(dim=-1).values)
    replacer = _moe("qwen3", torch.float32, RoutingHooks(_Observer(replace=True)))
    with torch.no_grad():
        assert not uses_fused_router(replacer, x)


def test_larger_batches_and_gradients_keep_the_eager_router(router):
    block = _moe("qwen3", torch.float32)
    with torch.no_grad():
        assert not uses_fused_router(block, torch.randn(router.MAX_TOKENS + 1, 32))
    assert not uses_fused_router(block, torch.randn(4, 32))  # grad enabled: training


def test_fused_moe_plans_again_for_another_row_block(router, grouped):
    """A layout of another row block than the tiles' is not used as is (``plan`` runs)."""
    from tests.kernels.test_moe_grouped import assert_close, make_experts

    experts = make_experts(32, 16, 16, 2, torch.float32)
    x = torch.randn(3, 32)
    spec = router.RouterSpec(16, 2)
    ids, routing = router.fused_route(make_logits(3, 16, seed=4), spec, None, 32, torch.float32)
    gemms = grouped.DenseExpertGemms(experts.gate_up_proj, experts.down_proj)
    got = grouped.fused_moe(x, ids, routing.weights_TK, gemms, routing=routing)  # the tiles' block_m is 16
    expected = grouped.grouped_moe_forward_reference(x, ids, routing.weights_TK, experts.gate_up_proj,
                                                     experts.down_proj)
    assert_close(got, expected, torch.float32)
