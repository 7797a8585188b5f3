"""DeepSeek-V3.2 (``deepseek_v32``, DeepSeek Sparse Attention) on the tiny model of
``family_acceptance.CASES`` (the indexer keeps 4 keys of contexts up to 29 tokens): training logits
against transformers (and dense attention differs), the same top-k in rollout and training in
bf16, MTP layers drafting in miles-spec. The checks every family passes: ``test_family_acceptance.py``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_host.models import ForwardContext, PackedAttention, load_pretrained, save_pretrained

from .conftest import hf_logits, prompts_batch
from .family_acceptance import VOCAB, family_lookup, tiny_checkpoint

transformers = pytest.importorskip("transformers")

lookup = family_lookup("deepseek_v32")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint("deepseek_v32", tmp_path_factory)


def test_logits_match_transformers_and_the_top_k_matters(checkpoint, tmp_path, monkeypatch):
    _, path = checkpoint
    input_ids, attention_mask = prompts_batch(VOCAB, lengths=(29, 6, 13))
    valid = attention_mask.bool()
    reference = hf_logits(path, input_ids, attention_mask)
    model = load_pretrained(path, family=lookup)
    assert model.config.dsa.index_topk == 4
    with torch.no_grad():
        logits = model(input_ids, attention_mask)
    assert (logits[valid] - reference[valid]).abs().max().item() <= 1e-4
    from miles_host.models import dsa

    monkeypatch.setattr(dsa, "INDEX_SCORE_ELEMENTS", 16 * 29 * 3)  # the indexer scores 3 queries at a time
    with torch.no_grad():
        assert torch.equal(model(input_ids, attention_mask), logits)
    # the same weights attending densely (top-k above every context) give other logits
    save_pretrained(model, tmp_path, family=lookup)
    dense = json.loads((path / "config.json").read_text()) | {"index_topk": 64}
    (tmp_path / "config.json").write_text(json.dumps(dense))
    assert (hf_logits(tmp_path, input_ids, attention_mask)[valid] - reference[valid]).abs().max().item() > 1e-2


def test_rollout_and_training_pick_the_same_keys_in_bfloat16(checkpoint, monkeypatch):
    """The engine's top-k (paged cache, decode steps) and the training forward's (packed) agree for
    every query of a sampled bf16 sequence: no indexer replay is needed for train/rollout agreement."""
    from miles_host.kernels import dsa as dsa_kernels
    from miles_host.models import dsa
    from miles_host.rollout import Engine

    model = load_pretrained(checkpoint[1], dtype=torch.bfloat16, family=lookup)
    rollout: dict[tuple[int, int], set[int]] = {}  # (layer, position) -> selected key positions
    paged, topk = dsa.paged_attend, dsa_kernels.topk_positions

    def recording_paged(layer, attention, q_TND, *rest):
        chosen = []
        monkeypatch.setattr(dsa_kernels, "topk_positions", lambda *a: chosen.append(topk(*a)) or chosen[-1])
        out = paged(layer, attention, q_TND, *rest)
        _, pos_T = dsa_kernels.step_tokens(attention.metadata, q_TND.shape[0])
        for position, row in zip(pos_T.tolist(), chosen[0].tolist()):
            rollout[(layer.layer_index, position)] = {j for j in row if j >= 0}
        return out

    from miles_host.rollout.attention import PagedAttention

    monkeypatch.setitem(dsa.DSA_CONTEXTS, PagedAttention, recording_paged)
    prompt = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    engine = Engine(model, kv_cache_tokens=256, block_size=8)
    params = {"temperature": 1.0, "max_new_tokens": 20, "ignore_eos": True, "sampling_seed": 3}
    output = engine.generate([prompt], params)
    monkeypatch.setattr(dsa_kernels, "topk_positions", topk)
    tokens = torch.tensor(prompt + output[0]["output_ids"][:-1])
    training = []
    selection = dsa._selection_QL
    monkeypatch.setattr(dsa, "_selection_QL", lambda *a: training.append(selection(*a)) or training[-1])
    with torch.no_grad():
        ctx = ForwardContext(PackedAttention(torch.tensor([0, len(tokens)])))
        model.forward_hidden(tokens, torch.arange(len(tokens)), ctx)
    assert len(rollout) == 2 * len(tokens)
    for (layer, position), chosen in rollout.items():
        assert chosen == set(training[layer][position].nonzero().flatten().tolist()), (layer, position)



@pytest.mark.slow
def test_mtp_weights_load_into_the_spec_draft_and_greedy_decoding_is_unchanged(checkpoint, tmp_path):
    """A checkpoint with an MTP layer (its indexer included) drafts through its own paged cache."""
    pytest.importorskip("miles_spec")
    from miles_host.rollout import Engine
    from miles_spec.draft import MTPDraft, attach_mtp
    from miles_spec.strategy import EagleStrategy

    from .family_acceptance import PROMPTS

    model = load_pretrained(checkpoint[1], family=lookup)
    torch.manual_seed(1)
    attach_mtp(model)
    save_pretrained(model, tmp_path, family=lookup)
    config = json.loads((tmp_path / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = load_file(tmp_path / "model.safetensors")  # published MTP layers carry embedding and head copies
    tensors["model.layers.2.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.2.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, tmp_path / "model.safetensors")
    with_mtp = load_pretrained(tmp_path, family=lookup)
    indexer = dict(with_mtp.mtp[0].attn.indexer.named_parameters())
    saved = dict(model.mtp[0].attn.indexer.named_parameters())
    assert indexer and all(torch.equal(t, saved[n]) for n, t in indexer.items())
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    expected = Engine(load_pretrained(checkpoint[1], family=lookup), kv_cache_tokens=512).generate(PROMPTS, greedy)
    engine = Engine(with_mtp, kv_cache_tokens=512, decoding_strategy=lambda e: EagleStrategy(e, MTPDraft(e.model), 3))
    assert [o["output_ids"] for o in engine.generate(PROMPTS, greedy)] == [o["output_ids"] for o in expected]
    assert engine.strategy.pop_counters().draft_tokens > 0
