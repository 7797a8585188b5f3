"""Speculative sampling reproduces the policy's distribution (chi-square tests)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from miles_host.rollout.sampler import truncation_mask
from miles_spec.sampling import accept
from tests.plugins.spec.conftest import spec_engine


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray, total: int) -> float:
    """Chi-square p-value, pooling cells with expected count < 5."""
    expected = np.asarray(probs, dtype=np.float64) * total
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum()).astype(np.float64)
    expected = np.append(expected[big], expected[~big].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    expected *= observed.sum() / expected.sum()
    return float(chisquare(observed, expected).pvalue)


def test_accept_rule_emits_the_target_at_every_chain_position():
    """Prefix-independent targets: the token at position j (when reached) follows p_j, whatever q is."""
    generator = torch.Generator().manual_seed(0)
    batch, k, vocab = 40000, 3, 6
    p = torch.softmax(torch.randn(k + 1, vocab, generator=generator) * 1.5, -1)
    q = torch.softmax(torch.randn(k, vocab, generator=generator) * 1.5, -1)
    drafts = torch.multinomial(q, batch, replacement=True, generator=generator).T
    uniforms = torch.rand(batch, k + 1, generator=generator)
    verdict = accept(p.expand(batch, -1, -1), p.log().expand(batch, -1, -1), q.expand(batch, -1, -1), drafts,
                     uniforms[:, :k], uniforms[:, k])
    for j in range(k):
        reached = verdict.num_accepted_B >= j
        tokens = verdict.tokens_BJ[reached, j].numpy()
        counts = np.bincount(tokens, minlength=vocab)
        assert _chi2_pvalue(counts, p[j].numpy(), len(tokens)) > 1e-3, j
    assert 0 < verdict.num_accepted_B.float().mean() < k


@pytest.mark.parametrize("top_p", [0.8])
def test_second_token_distribution_matches_the_policy(policy, bad_draft, top_p):
    """At T=1 the second generated token (the first speculative one) follows the policy exactly."""
    hf_model, path = policy
    prompt = [5, 9, 17, 33, 2]
    vocab = hf_model.config.vocab_size
    with torch.no_grad():  # exact marginal: sum over the first token
        first_logprobs = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, -1].float(), -1)
        keep = truncation_mask(first_logprobs[None], None, torch.tensor([top_p]), None)
        first = first_logprobs.exp() * (keep[0] if keep is not None else 1)
        first /= first.sum()
        batch = torch.tensor([prompt + [t] for t in range(vocab)])
        second_logprobs = torch.log_softmax(hf_model(batch).logits[:, -1].float(), -1)
        keep = truncation_mask(second_logprobs, None, torch.full((vocab,), top_p), None)
        second = second_logprobs.exp() * (keep if keep is not None else 1)
        second /= second.sum(-1, keepdim=True)
        marginal = (first[:, None] * second).sum(0).numpy()
    engine = spec_engine(path, draft_path=bad_draft[1], num_steps=3, max_num_seqs=256)
    params = {"temperature": 1.0, "top_p": top_p, "max_new_tokens": 2, "ignore_eos": True, "n": 250}
    torch.manual_seed(0)
    outputs = engine.generate([prompt] * 8, params)
    tokens = np.array([o["output_ids"][1] for o in outputs])
    counters = engine.strategy.pop_counters()
    assert 0.05 < counters.accepted_tokens / counters.draft_tokens < 0.95  # both accept and reject paths ran
    assert _chi2_pvalue(np.bincount(tokens, minlength=vocab), marginal, len(tokens)) > 1e-3
