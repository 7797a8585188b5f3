"""CPU tests of the fused MoE path in the model (routing variants) and of the one-program
routing kernel, under Triton's interpreter (not collected by itself).

Run by ``test_moe_grouped.py::test_fused_moe_under_the_triton_interpreter`` in a fresh
process with ``TRITON_INTERPRET=1``. Under the interpreter ``uses_triton`` is true on
CPU, so ``MoE.forward`` under ``no_grad`` takes the fused kernels exactly as on CUDA;
the oracle is the same module in float64 through the per-expert loop
(``moe_kernel = "loop"``). Shapes stay tiny (H=32, I=16, E=8).
"""

from __future__ import annotations

import copy

import pytest
import torch

from miles_host.models.config import MoEConfig
from miles_host.models.mlp import MoE, uses_fused_moe
from tests.kernels.test_moe_grouped import assert_close, routing_inputs
from tests.plugins.triton_interpret import interpreted_module

HIDDEN, INTER, EXPERTS = 32, 16, 8

#: every routing variant the fused path must cover (MoEConfig kwargs)
VARIANTS = {
    "softmax_norm_topk": dict(top_k=2, score_func="softmax", norm_topk_prob=True),
    "softmax_raw_weights": dict(top_k=3, score_func="softmax", norm_topk_prob=False),
    "sigmoid_group_limited_bias_scaled": dict(
        top_k=2, score_func="sigmoid", n_group=4, topk_group=2, expert_bias=True, routed_scaling_factor=2.5,
        norm_topk_prob=True, router_fp32=True),
    "shared_expert": dict(top_k=2, shared_intermediate_size=24),
    "shared_expert_gated": dict(top_k=2, shared_intermediate_size=24, shared_expert_gate=True),
}


@pytest.fixture(scope="module")
def kernels():
    return interpreted_module("miles_host.kernels.moe_grouped")


def make_moe(variant: str, dtype: torch.dtype, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(HIDDEN, MoEConfig(num_experts=EXPERTS, intermediate_size=INTER, **VARIANTS[variant]), "silu", 0)
    with torch.no_grad():
        for name, param in moe.named_parameters():
            param.copy_(torch.randn(param.shape) / param.shape[-1] ** 0.5)
        if moe.router.expert_bias is not None:
            moe.router.expert_bias.copy_(torch.randn(EXPERTS) * 0.1)
    return moe.to(dtype).eval()


def loop_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The same module in float64 through the per-expert loop."""
    reference = copy.deepcopy(moe).double()
    reference.experts.moe_kernel = "loop"
    with torch.no_grad():
        return reference(x.double())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("num_tokens", [1, 20])  # batch 1; batch > experts
def test_moe_block_matches_the_float64_loop(kernels, variant, num_tokens):
    moe = make_moe(variant, torch.float32)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens))
    with torch.no_grad():
        assert uses_fused_moe(moe.experts, x)
        got = moe(x)
    assert_close(got, loop_reference(moe, x), torch.float32)


@pytest.mark.parametrize("variant", ["softmax_norm_topk", "sigmoid_group_limited_bias_scaled"])
def test_moe_block_bf16(kernels, variant):
    moe = make_moe(variant, torch.bfloat16)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        got = moe(x)
        moe.experts.moe_kernel = "loop"
        loop = moe(x)
    assert got.dtype == torch.bfloat16
    assert_close(got, loop_reference(moe, x), torch.bfloat16)
    assert_close(got, loop, torch.bfloat16)


def test_gradients_and_loop_switch_take_the_loop(kernels):
    moe = make_moe("softmax_norm_topk", torch.float32)
    x = torch.randn(4, HIDDEN)
    assert not uses_fused_moe(moe.experts, x.requires_grad_())  # grad enabled: the training path
    moe.experts.moe_kernel = "loop"
    with torch.no_grad():
        assert not uses_fused_moe(moe.experts, x)


@pytest.mark.parametrize("num_tokens,top_k,block_m", [(1, 2, 16), (20, 2, 16), (7, 8, 32), (300, 2, 16)])
def test_route_kernel_layout_is_the_torch_layout(kernels, num_tokens, top_k, block_m):
    """Same padded rows and block experts as ``route`` (both stable); slots stay in their own order."""
    num_experts = 8 if top_k < 8 else 16
    _, ids, weights = routing_inputs(num_tokens, 4, num_experts, top_k, torch.float32, allowed=range(0, num_experts, 2)
                                     if top_k < 4 else None)
    expected = kernels.route(ids, weights, num_experts, block_m)
    got = kernels.plan(ids, weights, num_experts, block_m)
    assert torch.equal(got.row_token_R, expected.row_token_R)
    assert torch.equal(got.block_expert_B, expected.block_expert_B)
    assert torch.equal(got.weights_TK, weights)
    row_expert = got.block_expert_B.long().repeat_interleave(block_m)
    assert torch.equal(row_expert[got.pair_row_TK], ids)  # each slot's row is in its own expert's blocks
    assert torch.equal(got.row_token_R[got.pair_row_TK], torch.arange(num_tokens)[:, None].expand(-1, top_k))


def test_all_tokens_on_one_expert_and_empty_experts(kernels):
    """Every token's first slot is expert 5, the others among {1, 6}: five experts get no row."""
    from miles_host.kernels.moe_grouped import DenseExpertGemms, fused_moe, grouped_moe_forward_reference
    from tests.kernels.test_moe_grouped import make_experts

    experts = make_experts(HIDDEN, INTER, EXPERTS, 2, torch.float32)
    x, _, weights = routing_inputs(33, HIDDEN, EXPERTS, 2, torch.float32)
    ids = torch.stack([torch.full((33,), 5), torch.tensor([1, 6] * 16 + [1])], dim=1)
    got = fused_moe(x, ids, weights, DenseExpertGemms(experts.gate_up_proj, experts.down_proj))
    expected = grouped_moe_forward_reference(x, ids, weights, experts.gate_up_proj, experts.down_proj)
    assert_close(got, expected, torch.float32)
    one = fused_moe(x, ids[:, :1], weights[:, :1], DenseExpertGemms(experts.gate_up_proj, experts.down_proj))
    assert_close(one, grouped_moe_forward_reference(x, ids[:, :1], weights[:, :1], experts.gate_up_proj,
                                                    experts.down_proj), torch.float32)
