"""Online MTP training on the quickstart task: the mean accepted length rises."""

from __future__ import annotations

import json

import pytest

from miles_host.cli.main import main


@pytest.mark.slow
def test_mean_accepted_length_rises_over_the_quickstart(tmp_path):
    flags = ["--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "2",
             "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "3",
             "--mtp-num-layers", "1", "--enable-mtp-training", "--mtp-loss-scaling-factor", "1.0",
             "--num-rollout", "24", "--eval-interval", "24", "--no-progress", "--output-dir", str(tmp_path)]
    assert main(["run", *flags]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lengths = [r["spec/accept_len_mean"] for r in rows if "spec/accept_len_mean" in r]
    print(f"\nquickstart + online MTP: mean accepted length per rollout {[round(x, 2) for x in lengths]}")
    assert len(lengths) == 24
    first, last = sum(lengths[:5]) / 5, sum(lengths[-5:]) / 5
    assert last > first + 0.15, (first, last)
    accuracy = [r["eval/addition/accuracy"] for r in rows if "eval/addition/accuracy" in r]
    assert accuracy[-1] >= 0.8  # speculation does not change what the policy learns


def test_speculation_and_true_on_policy_together_are_refused(capsys):
    assert main(["run", "--sglang-speculative-algorithm", "EAGLE", "--true-on-policy", "--dry-run"]) == 2
    assert "not supported yet" in capsys.readouterr().err
