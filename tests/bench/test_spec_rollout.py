"""``bench/spec_rollout.py --tiny``: plain vs speculative rollout with online draft training rounds on CPU."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("miles_spec", reason="miles-spec is not installed")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tiny_spec_bench_trains_online_on_fresh_rollouts():
    out = subprocess.run([sys.executable, str(REPO / "bench" / "spec_rollout.py"), "--tiny", "--train-rounds", "3"],
                         capture_output=True, text=True, timeout=600, cwd=REPO, check=True)
    result = json.loads(out.stdout)
    assert result["draft_train_rounds"] == 3 and len(result["accept_len_per_round"]) == 3
    assert all(1.0 <= length <= 1 + result["num_steps"] for length in result["accept_len_per_round"])
    assert result["draft_loss_first_last"][1] < result["draft_loss_first_last"][0]  # the draft learns
    assert result["plain_tok_per_s"] > 0 and result["spec_tok_per_s"] > 0
    assert out.stderr.count("] round ") == 3


def test_bigram_language_follows_its_successor_at_the_stated_rate():
    sys.path.insert(0, str(REPO))
    from bench.structured_policy import BigramLanguage

    language = BigramLanguage(vocab=1000, size=50, follow=0.8)
    texts = language.sample(200, 100, seed=3)
    successor = {int(language.tokens[i]): int(language.tokens[language.successor[i]]) for i in range(50)}
    pairs = [(a, b) for text in texts for a, b in zip(text, text[1:])]
    assert {t for text in texts for t in text} <= set(successor)
    rate = sum(successor[a] == b for a, b in pairs) / len(pairs)
    expected = 0.8 + 0.2 / 50
    assert abs(rate - expected) < 4 * (expected * (1 - expected) / len(pairs)) ** 0.5
    p_next, p_other = expected, 0.2 / 50
    assert abs(language.entropy() - (-p_next * math.log(p_next) - 49 * p_other * math.log(p_other))) < 1e-5


@pytest.mark.slow
def test_tiny_spec_bench_on_a_fine_tuned_bigram_policy_accepts_more_as_the_draft_learns():
    out = subprocess.run([sys.executable, str(REPO / "bench" / "spec_rollout.py"), "--tiny", "--policy", "bigram"],
                         capture_output=True, text=True, timeout=600, cwd=REPO, check=True)
    result = json.loads(out.stdout)
    assert result["policy"] == "bigram" and result["sft_steps"] > 0
    assert result["policy_nll_mean"] < 1.5 * result["language_entropy"]  # the policy learned the language
    rounds = result["accept_len_per_round"]
    assert rounds[-1] > rounds[0] + 0.5 and result["accept_len_mean"] > 2.0  # the online draft learned it too
