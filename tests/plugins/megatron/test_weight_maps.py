"""miles-megatron: native <-> Megatron-Core weight maps round-trip for every family."""

from __future__ import annotations

import tempfile

import pytest
import torch

from miles_host.models import load_pretrained
from miles_megatron.plugin import megatron_available
from miles_megatron.weights import (
    megatron_to_native,
    megatron_transformer_config_kwargs,
    native_to_megatron,
    qkv_to_megatron,
)
from tests.models.conftest import CASES, build_hf_model


@pytest.fixture(scope="module", params=sorted(CASES))
def native_model(request):
    directory = tempfile.mkdtemp()
    build_hf_model(request.param).save_pretrained(directory)
    return load_pretrained(directory)


def test_round_trip_is_exact(native_model):
    state = native_model.state_dict()
    megatron = native_to_megatron(state, native_model.config)
    assert all(name.startswith(("decoder.", "embedding.", "output_layer.")) for name in megatron)
    back = megatron_to_native(megatron, native_model.config)
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_expert_and_norm_names(native_model):
    megatron = native_to_megatron(native_model.state_dict(), native_model.config)
    config = native_model.config
    assert "decoder.final_layernorm.weight" in megatron and "embedding.word_embeddings.weight" in megatron
    if config.moe is not None:
        layer = config.moe_layers.index(True)
        for expert in range(config.moe.num_experts):
            assert f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc1.weight" in megatron
        assert f"decoder.layers.{layer}.mlp.router.weight" in megatron
    if config.mla is not None:
        assert "decoder.layers.0.self_attention.linear_kv_down_proj.weight" in megatron


def test_qkv_interleave_matches_megatron_layout_built_by_hand():
    heads, kv_heads, head_dim, hidden = 4, 2, 3, 5
    q = torch.randn(heads * head_dim, hidden)
    k = torch.randn(kv_heads * head_dim, hidden)
    v = torch.randn(kv_heads * head_dim, hidden)
    rows = []
    for group in range(kv_heads):  # Megatron: per KV group, its query heads, then k, then v
        for head in range(group * 2, group * 2 + 2):
            rows.append(q[head * head_dim:(head + 1) * head_dim])
        rows.append(k[group * head_dim:(group + 1) * head_dim])
        rows.append(v[group * head_dim:(group + 1) * head_dim])
    assert torch.equal(qkv_to_megatron(torch.cat([q, k, v]), heads, kv_heads, head_dim), torch.cat(rows))


def test_unknown_weight_is_named():
    config = type("C", (), {"mla": None, "num_heads": 2, "num_kv_heads": 1, "head_dim": 2})()
    with pytest.raises(ValueError, match="layers.0.mystery"):
        native_to_megatron({"layers.0.mystery": torch.zeros(1)}, config)
    with pytest.raises(ValueError, match="decoder.layers.0.mystery"):
        megatron_to_native({"decoder.layers.0.mystery": torch.zeros(1)}, config)


def test_transformer_config_refuses_what_megatron_cannot_express(native_model):
    config = native_model.config
    rope, moe = config.rope, config.moe
    if config.mla is None:  # partial rotary as rotary_percent, interleaved pairs as rotary_interleaved
        rope_unsupported = rope.rope_type != "default"
    else:  # Megatron's MLA: rope or yarn, on interleaved pairs (HF's rope_interleave), no projection biases
        rope_unsupported = rope.rope_type not in ("default", "yarn") or not rope.interleaved or config.qkv_bias
    unsupported = (
        config.attn_logit_softcap is not None or config.sandwich_norm or "sliding_attention" in config.layer_types
        or rope_unsupported or config.qk_norm == "full" or config.o_bias or config.mlp_bias
        or config.norm_unit_offset or config.embed_scale is not None
    )
    # Megatron renormalises the chosen weights (softmax over the top-k; sigmoid scores over their sum)
    moe_unsupported = moe is not None and (
        not moe.norm_topk_prob or moe.shared_expert_gate or (moe.score_func == "softmax" and moe.expert_bias)
    )
    if unsupported or moe_unsupported:
        with pytest.raises(ValueError, match="does not support|use --train-backend native"):
            megatron_transformer_config_kwargs(config)
    else:
        kwargs = megatron_transformer_config_kwargs(config)
        assert kwargs["num_query_groups"] == config.num_kv_heads


def test_backend_without_megatron_core_says_how_to_install_it(monkeypatch):
    import sys

    from miles_megatron.plugin import _megatron_trainer

    monkeypatch.setitem(sys.modules, "megatron.core", None)  # import fails as if not installed
    ok, why = megatron_available()
    assert not ok and "pip install megatron-core" in why
    with pytest.raises(ValueError, match="--train-backend megatron: megatron-core is not installed.*pip install megatron-core"):
        _megatron_trainer(None, None)


def _with_fresh_mtp_layer(model):
    """``model`` with one MTP layer as miles-spec attaches it (no private embedding/head copies)."""
    from miles_host.models.model import MTPLayer

    layer = MTPLayer(model.config, model.config.num_layers, model.routing_hooks)
    layer.embed_tokens = layer.head = None
    with torch.no_grad():
        for parameter in layer.parameters():  # experts are allocated uninitialised (NaN != NaN)
            parameter.normal_()
    model.mtp = torch.nn.ModuleList([layer])
    return model


def test_mtp_layer_round_trip_is_exact(native_model):
    state = _with_fresh_mtp_layer(native_model).state_dict()
    megatron = native_to_megatron(state, native_model.config)
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
            "mtp.layers.0.final_layernorm.weight", "mtp.layers.0.transformer_layer.input_layernorm.weight"} <= set(megatron)
    back = megatron_to_native(megatron, native_model.config)
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_mtp_layer_with_private_embedding_is_refused(native_model):
    state = {"mtp.0.embed_tokens.weight": torch.zeros(4, 4)}
    with pytest.raises(ValueError, match="share the policy's embedding"):
        native_to_megatron(state, native_model.config)
