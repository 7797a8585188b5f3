"""CPU tests of gpt-oss' experts on the fused MoE kernels (per-expert biases, clamped SwiGLU) under
Triton's interpreter (not collected by itself).

Run by ``test_moe_grouped.py::test_gpt_oss_experts_under_the_triton_interpreter`` in a fresh
process with ``TRITON_INTERPRET=1``. Oracles: the float64 per-expert reference
(``grouped_moe_forward_reference`` with biases and limit), eager bf16 ops on exactly
representable GEMMs for the epilogue's rounding, and ``VariantExperts`` through the
per-expert loop in float64. Shapes stay tiny (H=32, I=16, E=8, K=2).
"""

from __future__ import annotations

import copy

import pytest
import torch

from miles_host.kernels.eager_ops import clamped_swiglu
from miles_host.models.config import MoEConfig
from tests.kernels.test_moe_grouped import assert_close, make_experts, routing_inputs
from tests.plugins.triton_interpret import interpreted_module

HIDDEN, INTER, EXPERTS, TOP_K = 32, 16, 8, 2
#: small enough that many gate / up pre-activations (O(1)) lie beyond it
LIMIT, ALPHA = 0.7, 1.702


@pytest.fixture(scope="module")
def kernels():
    return interpreted_module("miles_host.kernels.moe_grouped")


def _gpt_oss_args(num_tokens, dtype, allowed=None, seed=0):
    """Inputs and the keyword arguments of gpt-oss' experts: random biases, the clamp on."""
    experts = make_experts(HIDDEN, INTER, EXPERTS, TOP_K, dtype, seed=seed)
    generator = torch.Generator().manual_seed(seed + 7)
    x, ids, weights = routing_inputs(num_tokens, HIDDEN, EXPERTS, TOP_K, dtype, allowed=allowed)
    extras = dict(
        gate_up_bias_E2I=(torch.randn(EXPERTS, 2 * INTER, generator=generator) * 0.5).to(dtype),
        down_bias_EH=(torch.randn(EXPERTS, HIDDEN, generator=generator) * 0.5).to(dtype),
        swiglu_limit=LIMIT, swiglu_alpha=ALPHA,
    )
    return (x, ids, weights, experts.gate_up_proj, experts.down_proj, "clamped_swiglu"), extras


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 37])  # batch 1; ragged; batch > experts
def test_matches_the_float64_reference(kernels, dtype, num_tokens):
    args, extras = _gpt_oss_args(num_tokens, dtype)
    got = kernels.grouped_moe_forward(*args, **extras)
    assert got.shape == (num_tokens, HIDDEN) and got.dtype == dtype
    expected = kernels.grouped_moe_forward_reference(*args, **extras)
    assert_close(got, expected, dtype)
    # the limit is active, and the biases matter: without them the result is far off
    x, _, _, gate_up = args[:4]
    assert (x.double() @ gate_up[0].double().t()).abs().max() > 2 * LIMIT
    no_bias = kernels.grouped_moe_forward_reference(*args, swiglu_limit=LIMIT, swiglu_alpha=ALPHA)
    assert (no_bias.double() - expected.double()).abs().max() > 0.1


def test_empty_experts_and_block_sizes(kernels):
    """Only experts 1 and 6 chosen (six experts without rows); the row block changes the layout only."""
    args, extras = _gpt_oss_args(17, torch.float32, allowed=[1, 6])
    expected = kernels.grouped_moe_forward_reference(*args, **extras)
    for block_m in (16, 32):
        assert_close(kernels.grouped_moe_forward(*args, block_m=block_m, **extras), expected, torch.float32)


def test_biases_alone_with_silu(kernels):
    """Biases without the clamp: the plain activations' epilogue plus the bias rows."""
    args, extras = _gpt_oss_args(9, torch.float32)
    del extras["swiglu_limit"], extras["swiglu_alpha"]
    args = (*args[:5], "silu")
    assert_close(kernels.grouped_moe_forward(*args, **extras), kernels.grouped_moe_forward_reference(*args, **extras),
                 torch.float32)


def test_epilogue_rounds_as_the_eager_bf16_ops(kernels):
    """One-hot rows make every GEMM exact in fp32, so the gate_up epilogue's output must be the eager
    bf16 ops' bit for bit: ``F.linear``'s one rounding of product + bias, then each op of the clamp."""
    from miles_host.kernels.moe_grouped import DenseExpertGemms, gemm_config, plan

    dtype = torch.bfloat16
    args, extras = _gpt_oss_args(HIDDEN, dtype)
    x = torch.eye(HIDDEN, dtype=dtype) * 4  # x[t] @ W^T = 4 * W[:, t], exact
    ids = args[1]
    gemms = DenseExpertGemms(args[3], args[4], "clamped_swiglu", extras["gate_up_bias_E2I"], extras["down_bias_EH"],
                             LIMIT, ALPHA)
    routing = plan(ids, args[2], EXPERTS, 16)
    act_RI = torch.zeros(routing.row_token_R.shape[0], INTER, dtype=dtype)
    gemms.gate_up(x, routing, act_RI, gemm_config(16, INTER, HIDDEN, dtype))
    for token in range(HIDDEN):
        for slot in range(TOP_K):
            expert = ids[token, slot].item()
            gate_up = (x[token].float() @ args[3][expert].float().t() + extras["gate_up_bias_E2I"][expert].float())
            gate, up = gate_up.to(dtype).chunk(2)
            expected = clamped_swiglu(gate, up, LIMIT, ALPHA)  # eager bf16 ops, each rounded
            got = act_RI[routing.pair_row_TK[token, slot]]
            assert torch.equal(got, expected), (token, slot, got, expected)


def _variant_experts(dtype):
    from miles_host.models.moe_variants import VariantExperts

    torch.manual_seed(0)
    moe = MoEConfig(num_experts=EXPERTS, top_k=TOP_K, intermediate_size=INTER, expert_biases=True,
                    swiglu_limit=LIMIT, swiglu_alpha=ALPHA)
    experts = VariantExperts(HIDDEN, moe, "silu")
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape) / param.shape[-1] ** 0.5 + (0.3 if param.dim() == 2 else 0.0))
    return experts.to(dtype).requires_grad_(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 20])
def test_variant_experts_take_the_fused_path(kernels, monkeypatch, dtype, num_tokens):
    """``VariantExperts`` at inference runs ``fused_moe`` (biases, clamp) and matches its own loop in float64."""
    from miles_host.kernels import moe_grouped

    experts = _variant_experts(dtype)
    x, ids, weights = routing_inputs(num_tokens, HIDDEN, EXPERTS, TOP_K, dtype, seed=num_tokens)
    calls = []
    original = moe_grouped.fused_moe
    monkeypatch.setattr(moe_grouped, "fused_moe", lambda *a, **k: calls.append(1) or original(*a, **k))
    with torch.no_grad():
        got = experts(x, ids, weights)
        reference = copy.deepcopy(experts).double()
        reference.moe_kernel = "loop"
        expected = reference(x.double(), ids, weights.double())
    assert calls == [1]
    assert_close(got, expected, dtype)


def test_loop_switch_and_batch_invariant_mode_keep_the_loop(kernels, monkeypatch):
    from miles_host.kernels import moe_grouped
    from miles_host.models import mlp

    experts = _variant_experts(torch.float32)
    x, ids, weights = routing_inputs(6, HIDDEN, EXPERTS, TOP_K, torch.float32)
    monkeypatch.setattr(moe_grouped, "fused_moe", lambda *a, **k: pytest.fail("the fused path ran"))
    with torch.no_grad():
        experts.moe_kernel = "loop"
        expected = mlp.routed_forward(x, ids, weights, EXPERTS, experts.expert_mlp)
        assert torch.equal(experts(x, ids, weights), expected)
        experts.moe_kernel = "fused"
        monkeypatch.setattr(mlp, "_invariant_active", lambda: True)
        assert not mlp.uses_fused_moe(experts, x)
        torch.testing.assert_close(experts(x, ids, weights), expected, rtol=1e-6, atol=1e-6)


def test_gpt_oss_logits_on_the_fused_experts_match_transformers(kernels, tmp_path, monkeypatch):
    """The tiny gpt-oss checkpoint of the family tests (its limit clamps): logits with every MoE layer
    on the fused kernels against transformers (float32)."""
    pytest.importorskip("transformers")
    from miles_host.kernels import moe_grouped
    from miles_host.models import load_pretrained
    from tests.models.conftest import hf_logits, prompts_batch
    from tests.models.test_sinks_chunked_families import build, family_lookup

    build("gpt_oss").save_pretrained(tmp_path)
    input_ids, attention_mask = prompts_batch(lengths=(13, 6, 9))
    reference = hf_logits(tmp_path, input_ids, attention_mask)
    model = load_pretrained(tmp_path, family=family_lookup)
    calls = []
    original = moe_grouped.fused_moe
    monkeypatch.setattr(moe_grouped, "fused_moe", lambda *a, **k: calls.append(1) or original(*a, **k))
    with torch.no_grad():
        logits = model(input_ids, attention_mask)
    assert len(calls) == 2  # both layers' experts
    valid = attention_mask.bool()
    assert (logits[valid] - reference[valid]).abs().max().item() <= 1e-4
