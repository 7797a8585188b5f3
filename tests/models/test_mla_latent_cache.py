"""DeepSeek MLA over the engine's latent cache (``--mla-kv-cache latent``): one row of
``kv_lora_rank + qk_rope_head_dim`` per token and layer, queries absorbed into the latent space.
Against transformers (greedy tokens, log-probs), the expanded cache, and through prefix sharing,
preemption and chunked prefill; ``--true-on-policy`` keeps the expanded cache."""

from __future__ import annotations

import pytest
import torch

from miles_host.kernels import switches
from miles_host.models import load_pretrained
from miles_host.rollout import Engine
from tests.models.conftest import family_lookup
from tests.models.family_acceptance import (
    assert_engine_matches_transformers,
    assert_gpu_engine_matches_transformers,
    assert_small_cache_engine_matches,
)

pytest.importorskip("transformers")

CASES = ("deepseek_v3", "deepseek_v3_no_q_lora")


@pytest.fixture(autouse=True)
def latent_cache():
    """Every engine of these tests caches its MLA layers as latents unless a test switches back."""
    with switches.switched(mla_kv_cache="latent"):
        yield


def _mla_widths(model) -> tuple[int, int, int, int]:
    """``(heads, latent rank, rope dims, per-head k + v dims)`` of the model's MLA layers."""
    mla = model.config.mla
    return model.config.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_head_dim + mla.v_head_dim


@pytest.mark.parametrize("case", CASES)
def test_latent_cache_engine_matches_transformers(case, checkpoints):
    import transformers

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[case]).float().eval()
    model = load_pretrained(checkpoints[case], family=family_lookup)
    engine = assert_engine_matches_transformers(hf_model, model)
    heads, rank, rope, per_head = _mla_widths(model)
    assert set(engine.kv_cache.layout) == {(1, rank + rope, 0, None)}
    assert engine.kv_bytes_per_token == model.config.num_layers * (rank + rope) * 4  # float32
    with switches.switched(mla_kv_cache="expanded"):
        expanded = Engine(model, kv_cache_tokens=512, block_size=4)
    assert set(expanded.kv_cache.layout) == {(heads, model.config.mla.qk_head_dim, model.config.mla.v_head_dim, None)}
    assert expanded.kv_bytes_per_token == model.config.num_layers * heads * per_head * 4


def test_latent_and_expanded_caches_give_the_same_tokens(checkpoints):
    model = load_pretrained(checkpoints["deepseek_v3"], family=family_lookup)
    params = {"temperature": 0.8, "max_new_tokens": 12, "ignore_eos": True, "n": 2, "sampling_seed": 3}
    prompts = [[5, 9, 3, 17, 4], [8, 2, 2, 11]]
    latent = Engine(model, kv_cache_tokens=256, block_size=4).generate(prompts, params)
    with switches.switched(mla_kv_cache="expanded"):
        expanded = Engine(model, kv_cache_tokens=256, block_size=4).generate(prompts, params)
    assert [o["output_ids"] for o in latent] == [o["output_ids"] for o in expanded]
    for a, b in zip(latent, expanded):
        pairs = zip(a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"])
        assert max(abs(x[0] - y[0]) for x, y in pairs) <= 1e-5


def test_prefix_sharing_preemption_and_chunked_prefill_over_latents(checkpoints):
    """The default expanded prefill: chunks after the first and requests sharing a cached prefix gather
    earlier pages' latents."""
    assert_small_cache_engine_matches(load_pretrained(checkpoints["deepseek_v3"], family=family_lookup))


@pytest.mark.parametrize("case", CASES[:1])
def test_absorbed_prefill_over_latents_matches_transformers(case, checkpoints):
    """``--mla-prefill absorbed``: prefill steps run the latent kernel as decode does (the default
    expands each context's cached latents to per-head keys and values); greedy tokens and log-probs
    as transformers'."""
    import transformers

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[case]).float().eval()
    model = load_pretrained(checkpoints[case], family=family_lookup)
    with switches.switched(mla_prefill="absorbed"):
        assert_engine_matches_transformers(hf_model, model)


def test_absorbed_prefill_through_prefix_sharing_preemption_and_chunked_prefill(checkpoints):
    """Chunks after the first and requests sharing a cached prefix attend earlier pages' latents."""
    with switches.switched(mla_prefill="absorbed"):
        assert_small_cache_engine_matches(load_pretrained(checkpoints["deepseek_v3"], family=family_lookup))


def test_expanded_prefill_gives_the_absorbed_rows(checkpoints, monkeypatch):
    """One prefill step over a cached prefix, the layer's output both ways: the same attention in
    another order of the same products (float32: within rounding)."""
    from miles_host.rollout.attention import PagedAttention

    model = load_pretrained(checkpoints["deepseek_v3"], family=family_lookup)
    calls = []
    original = PagedAttention.attend_latent_expanded
    monkeypatch.setattr(PagedAttention, "attend_latent_expanded",
                        lambda self, *a, **k: calls.append(self.metadata.context_lens_host) or original(self, *a, **k))
    prompts = [[5, 9, 3, 17, 4, 8, 2, 2, 11, 6], [5, 9, 3, 17, 4, 8, 7]]
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    outputs = {}
    for prefill in ("absorbed", "expanded"):
        with switches.switched(mla_prefill=prefill):
            engine = Engine(model, kv_cache_tokens=256, block_size=4, max_num_batched_tokens=6)
            outputs[prefill] = engine.generate(prompts, params)
    assert calls and any(max(lengths) > 6 for lengths in calls), "no chunk attended a cached prefix"
    assert [o["output_ids"] for o in outputs["absorbed"]] == [o["output_ids"] for o in outputs["expanded"]]
    for a, b in zip(outputs["absorbed"], outputs["expanded"]):
        pairs = zip(a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"])
        assert max(abs(x[0] - y[0]) for x, y in pairs) <= 1e-5


def test_true_on_policy_and_a_bf16_weight_keep_what_they_need(checkpoints):
    """Batch-invariant rollouts compute per head, as training does: the expanded cache."""
    model = load_pretrained(checkpoints["deepseek_v3"], family=family_lookup)
    heads = model.config.num_heads
    engine = Engine(model, kv_cache_tokens=64, block_size=4, batch_invariant=True)
    assert all(entry[0] == heads for entry in engine.kv_cache.layout)
    attn = model.layers[0].attn
    attn.logit_softcap = 30.0  # no soft-capping in the latent kernel: this layer expands
    assert not attn.can_cache_latents() and attn.layout(latent=True)[0] == heads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("prefill", ["absorbed", "expanded"])
def test_gpu_latent_cache_engine_matches_transformers(case, prefill, checkpoints):
    """Float32 on CUDA: the Triton latent kernel (prefill too, or the paged kernel over expanded
    latents with ``--mla-prefill expanded``), decode in CUDA graphs."""
    import transformers

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[case]).float().eval()
    with switches.switched(mla_prefill=prefill):
        assert_gpu_engine_matches_transformers(hf_model, load_pretrained(checkpoints[case], family=family_lookup))


def test_context_groups_bound_each_group_but_keep_a_long_context_whole():
    from miles_host.rollout.attention import context_groups

    assert context_groups([5, 4, 3, 9, 2], 9) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert context_groups([5, 20, 1], 9) == [(0, 1), (1, 2), (2, 3)]  # 20 alone
    assert context_groups([5, 4, 3], None) == [(0, 3)]
    assert context_groups([7], 4) == [(0, 1)]


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                      reason="needs a CUDA GPU")]),
])
def test_expanded_prefill_in_groups_of_sequences_gives_the_absorbed_rows(device, checkpoints, monkeypatch):
    """A prefill step whose contexts sum past EXPANDED_PREFILL_MAX_CONTEXT expands and attends its
    sequences a group at a time (each group's own metadata; on CUDA the paged Triton kernel per
    group): the same tokens and log-probs as the absorbed prefill, within rounding."""
    from miles_host.models import self_attention
    from miles_host.rollout.attention import PagedAttention

    model = load_pretrained(checkpoints["deepseek_v3"], family=family_lookup).to(device)
    engine_args = dict(kv_cache_tokens=256, block_size=4) if device == "cpu" else dict(
        kv_cache_tokens=None, max_num_seqs=8, mem_fraction_static=0.3, max_kv_cache_tokens=4096)
    groups = []
    layouts = []
    original = PagedAttention._attend_expanded
    monkeypatch.setattr(PagedAttention, "_attend_expanded", lambda self, cache, rank, q, expand, scale, layout: (
        groups.append((q.shape[0], layout.metadata.context_lens_host)) or layouts.append(id(layout))
        or original(self, cache, rank, q, expand, scale, layout)))
    monkeypatch.setattr(self_attention, "EXPANDED_PREFILL_MAX_CONTEXT", 12)
    prompts = [[5, 9, 3, 17, 4, 8, 2], [8, 2, 2, 11, 6], [7, 1, 4, 9, 3, 3, 12, 30]]
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    outputs = {}
    for prefill in ("absorbed", "expanded"):
        with switches.switched(mla_prefill=prefill):
            outputs[prefill] = Engine(model, **engine_args).generate(prompts, params)
    assert (12, [7, 5]) in groups, groups  # the one prefill step, split by the bound
    # every group of several sequences within the bound (on CUDA the engine's start-up memory probe
    # prefills max_model_len - 1 tokens per sequence: one long context alone per group)
    assert all(sum(contexts) <= 12 or len(contexts) == 1 for _, contexts in groups), groups
    assert len(set(layouts)) * 2 <= len(layouts)  # a step's group layouts built once, for every layer
    assert [o["output_ids"] for o in outputs["absorbed"]] == [o["output_ids"] for o in outputs["expanded"]]
    for a, b in zip(outputs["absorbed"], outputs["expanded"]):
        pairs = zip(a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"])
        assert max(abs(x[0] - y[0]) for x, y in pairs) <= (1e-5 if device == "cpu" else 1e-4)


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                      reason="needs a CUDA GPU")]),
])
def test_expanded_prefill_over_a_long_context_in_key_parts_gives_the_absorbed_rows(device, checkpoints, monkeypatch):
    """A context past EXPANDED_PREFILL_MAX_CONTEXT tokens is expanded and attended in parts of at most that
    many keys (the last chunk of a chunked prefill over its cached prefix too), merged by their log-sum-exps
    (on CUDA the paged Triton kernel over a key range): the absorbed prefill's tokens and log-probs."""
    from miles_host.models import self_attention
    from miles_host.rollout.attention import PagedAttention

    model = load_pretrained(checkpoints["deepseek_v3"], family=family_lookup).to(device)
    bound, chunk = (8, 6) if device == "cpu" else (96, 128)  # CUDA: parts past the kernel's key block
    engine_args = dict(kv_cache_tokens=256, block_size=4) if device == "cpu" else dict(
        kv_cache_tokens=None, max_num_seqs=8, mem_fraction_static=0.3, max_kv_cache_tokens=4096)
    parts, absorbed = [], []
    original = PagedAttention._attend_expanded
    monkeypatch.setattr(PagedAttention, "_attend_expanded", lambda self, cache, rank, q, expand, scale, layout: (
        parts.append((layout.metadata.context_lens_host, layout.keys))
        or original(self, cache, rank, q, expand, scale, layout)))
    original_absorbed = PagedAttention.attend_latent
    monkeypatch.setattr(PagedAttention, "attend_latent", lambda self, *a, **k: absorbed.append(
        self.metadata.is_decode) or original_absorbed(self, *a, **k))
    monkeypatch.setattr(self_attention, "EXPANDED_PREFILL_MAX_CONTEXT", bound)
    vocab = model.config.vocab_size
    prompts = [[(7 * i + 3) % vocab for i in range(length)] for length in ((21, 3) if device == "cpu" else (200, 40))]
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    outputs = {}
    for prefill in ("absorbed", "expanded"):
        parts.clear(), absorbed.clear()
        with switches.switched(mla_prefill=prefill):
            outputs[prefill] = Engine(model, max_num_batched_tokens=chunk, **engine_args).generate(prompts, params)
    assert absorbed and all(absorbed), "a prefill step ran absorbed"  # the expanded run's: decode steps only
    long_context = [(contexts, keys) for contexts, keys in parts if keys is not None]
    assert any(contexts[0] == len(prompts[0]) for contexts, _ in long_context), parts  # its last chunk, in parts
    assert all(keys[1] - keys[0] <= bound for _, keys in long_context)
    assert [o["output_ids"] for o in outputs["absorbed"]] == [o["output_ids"] for o in outputs["expanded"]]
    for a, b in zip(outputs["absorbed"], outputs["expanded"]):
        pairs = zip(a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"])
        assert max(abs(x[0] - y[0]) for x, y in pairs) <= (1e-5 if device == "cpu" else 1e-4)