"""Shared blocks against independent float64 references."""

from __future__ import annotations

import math

import pytest
import torch

from miles_host.models import ContiguousKVCache, ModelConfig, MoEConfig, PackedAttention, RopeConfig
from miles_host.models.rope import inverse_frequencies


def _naive_attention(q, k, v, scale, window, softcap):
    """One sequence, float64 loops-free reference: q [T, Hq, D], k/v [T, Hkv, D*]."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    t = torch.arange(q.shape[0])
    allowed = t[None, :] <= t[:, None]
    if window is not None:
        allowed &= t[None, :] > t[:, None] - window
    scores = scores.masked_fill(~allowed, -math.inf)
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


@pytest.mark.parametrize("window,softcap", [(None, None), (3, None), (None, 0.8), (4, 1.5)])
def test_packed_and_cached_attention_match_reference(window, softcap):
    torch.manual_seed(0)
    lengths = [7, 1, 12, 5]
    total = sum(lengths)
    q = torch.randn(total, 4, 8, dtype=torch.float64)
    k = torch.randn(total, 2, 8, dtype=torch.float64)
    v = torch.randn(total, 2, 6, dtype=torch.float64)  # value head dim differs (MLA)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedAttention(cu).attend(0, q, k, v, scale=0.3, sliding_window=window, logit_softcap=softcap)
    expected = torch.cat([
        _naive_attention(q[s:e], k[s:e], v[s:e], 0.3, window, softcap) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())
    ])
    torch.testing.assert_close(packed, expected)

    cache = ContiguousKVCache()
    outputs = []
    # prefill the first 3 tokens of every sequence (fewer if shorter), then one token at a time
    done = [0] * len(lengths)
    while any(d < n for d, n in zip(done, lengths)):
        ids = [s for s in range(len(lengths)) if done[s] < lengths[s]]
        counts = [min(3, lengths[s]) if done[s] == 0 else 1 for s in ids]
        cache.set_batch(ids, counts)
        rows = torch.cat([torch.arange(cu[s] + done[s], cu[s] + done[s] + c) for s, c in zip(ids, counts)])
        out = cache.attend(0, q[rows], k[rows], v[rows], scale=0.3, sliding_window=window, logit_softcap=softcap)
        outputs.append((rows, out))
        cache.commit()
        for s, c in zip(ids, counts):
            done[s] += c
    cached = torch.empty_like(expected)
    for rows, out in outputs:
        cached[rows] = out
    torch.testing.assert_close(cached, expected)


def test_rope_scalings_match_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = [
        ("linear", dict(factor=4.0)),
        ("llama3", dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)),
        ("yarn", dict(factor=4.0, original_max_position_embeddings=64, beta_fast=16, beta_slow=2)),
        ("yarn", dict(factor=8.0, original_max_position_embeddings=64, mscale=0.7, mscale_all_dim=1.0)),
    ]
    for rope_type, params in cases:
        hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=512,
                                      rope_parameters={"rope_type": rope_type, "rope_theta": 5000.0, **params})
        expected, expected_factor = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
        ours, factor = inverse_frequencies(RopeConfig(rotary_dim=32, theta=5000.0, rope_type=rope_type, **params))
        torch.testing.assert_close(ours, expected)
        assert factor == pytest.approx(expected_factor)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("rope", [RopeConfig(rotary_dim=64, theta=1e6), RopeConfig(
    rotary_dim=64, theta=1e4, rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
    mscale_all_dim=1.0)])
def test_rotary_table_rows_are_the_computed_rows(rope, device):
    """The cached table's rows (what decode-graph captures gather) are the directly computed cos and
    sin bit for bit, at any positions below its bound, in bf16 and fp32."""
    from miles_host.models.rope import RotaryEmbedding

    module = RotaryEmbedding(rope)
    positions = torch.tensor([0, 1, 7, 255, 4095, 4096, 9999, 32767], device=device)
    for dtype in (torch.bfloat16, torch.float32):
        module.cache_table(32768, torch.device(device), dtype)
        assert module(positions, dtype)[0].dtype == dtype  # outside a capture: computed
        for got, want in zip(module.lookup(positions), module(positions, dtype)):
            assert torch.equal(got, want)


def _config(**overrides):
    fields = dict(model_type="t", vocab_size=16, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                  intermediate_size=8, rope=RopeConfig(rotary_dim=4))
    return ModelConfig(**{**fields, **overrides})


@pytest.mark.parametrize("overrides,message", [
    (dict(num_heads=3, num_kv_heads=2), "multiple of num_kv_heads"),
    (dict(hidden_act="relu6"), "unsupported hidden_act"),
    (dict(layer_types=["full_attention"]), "layer_types has 1 entries"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "sliding_window"),
    (dict(moe_layers=[True, False]), "MoE layers"),
    (dict(rope=RopeConfig(rotary_dim=8)), "rotary_dim"),
])
def test_model_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(**overrides)


def test_moe_config_validation():
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(num_experts=4, top_k=5, intermediate_size=8)
    with pytest.raises(ValueError, match="n_group"):
        MoEConfig(num_experts=6, top_k=2, intermediate_size=8, n_group=4, topk_group=1)
    with pytest.raises(ValueError, match="rope_type"):
        RopeConfig(rotary_dim=4, rope_type="dynamic")
