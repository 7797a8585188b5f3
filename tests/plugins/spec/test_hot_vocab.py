"""FR-Spec token maps (``--sglang-speculative-token-map``): the draft proposes only the map's
tokens; output stays exactly the policy's (greedy token for token, sampled in distribution)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.plugins.spec.conftest import plain_engine, spec_engine
from tests.plugins.spec.test_distribution import _chi2_pvalue


def test_hot_head_logits_are_the_full_heads_inside_the_map_and_minus_inf_outside():
    from miles_spec.hot_vocab import HotVocabHead

    torch.manual_seed(0)
    weight = torch.randn(50, 8, dtype=torch.float64)
    ids = torch.tensor([1, 7, 20, 49])
    head = HotVocabHead(ids, lambda: weight, softcap=3.0)
    hidden = torch.randn(5, 8, dtype=torch.float64)
    full = torch.tanh(hidden @ weight.T / 3.0) * 3.0
    got = head.logits(hidden)
    assert torch.allclose(got[:, ids], full[:, ids], atol=1e-12)
    outside = torch.ones(50, dtype=torch.bool)
    outside[ids] = False
    assert bool(torch.isneginf(got[:, outside]).all())
    buffer = head.weight_NH
    weight.mul_(2.0)  # a weight update: refresh re-gathers into the same buffer
    head.refresh()
    assert head.weight_NH is buffer and torch.equal(buffer, weight[ids])


def test_greedy_with_a_token_map_equals_plain(policy, bad_draft):
    _, path = policy
    prompts = [[5, 9, 17, 33, 2], [3, 3, 8], [100, 7, 64, 12, 90, 1]]
    params = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    expected = [o["output_ids"] for o in plain_engine(path).generate(prompts, params)]
    hot = sorted({t for tokens in expected for t in tokens[::2]})  # half the tokens the policy emits, at most
    for draft_path in (None, bad_draft[1]):
        engine = spec_engine(path, draft_path=draft_path, token_map=torch.tensor(hot))
        assert [o["output_ids"] for o in engine.generate(prompts, params)] == expected
        counters = engine.strategy.pop_counters()
        assert counters.draft_tokens > 0


def test_sampled_tokens_follow_the_policy_when_the_draft_cannot_propose_most_tokens(policy, bad_draft):
    """The second token at T=1 (the first speculative one) against the exact marginal, with a draft
    restricted to 16 of 128 tokens: the residual covers the rest."""
    hf_model, path = policy
    prompt = [5, 9, 17, 33, 2]
    vocab = hf_model.config.vocab_size
    with torch.no_grad():
        first = torch.softmax(hf_model(torch.tensor([prompt])).logits[0, -1].double(), -1)
        second = torch.softmax(hf_model(torch.tensor([prompt + [t] for t in range(vocab)])).logits[:, -1].double(), -1)
        marginal = (first[:, None] * second).sum(0).numpy()
    hot = np.argsort(-marginal)[:16].tolist()
    engine = spec_engine(path, draft_path=bad_draft[1], num_steps=3, max_num_seqs=256, token_map=torch.tensor(hot))
    torch.manual_seed(0)
    outputs = engine.generate([prompt] * 8, {"temperature": 1.0, "max_new_tokens": 2, "ignore_eos": True, "n": 250})
    tokens = np.array([o["output_ids"][1] for o in outputs])
    assert not set(tokens.tolist()) <= set(hot)  # tokens outside the map were emitted (by the residual)
    assert _chi2_pvalue(np.bincount(tokens, minlength=vocab), marginal, len(tokens)) > 1e-3


def test_token_map_files(tmp_path):
    from miles_spec.hot_vocab import frequent_tokens, load_token_map

    torch.save(torch.tensor([9, 3, 3, 7]), tmp_path / "hot_token_id.pt")
    assert load_token_map(str(tmp_path / "hot_token_id.pt"), 10).tolist() == [3, 7, 9]
    (tmp_path / "map.json").write_text(json.dumps([4, 1]))
    assert load_token_map(str(tmp_path / "map.json"), 10).tolist() == [1, 4]
    with pytest.raises(ValueError, match=r"must lie in \[0, 8\)"):
        load_token_map(str(tmp_path / "hot_token_id.pt"), 8)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_token_map(str(tmp_path / "missing.pt"), 10)
    torch.save(torch.tensor([[1, 2]]), tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="1-D list of integer"):
        load_token_map(str(tmp_path / "bad.pt"), 10)
    assert frequent_tokens([[5, 5, 2], [2, 5, 8, 9]], 2).tolist() == [2, 5]


def test_weight_sync_refreshes_the_token_maps_rows(policy):
    _, path = policy
    engine = spec_engine(path, token_map=torch.tensor([2, 11, 40]))
    weight = engine.model.lm_head_weight
    name = next(n for n, p in engine.model.named_parameters() if p is weight)
    engine.update_weights([(name, weight.detach() * 3.0)])
    assert torch.equal(engine.strategy.draft.hot.weight_NH, engine.model.lm_head_weight[[2, 11, 40]])
