"""``bench/spec_rollout.py --tiny``: plain vs speculative rollout with online draft training rounds on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("miles_spec", reason="miles-spec is not installed")

REPO = Path(__file__).resolve().parents[2]


def test_tiny_spec_bench_trains_online_on_fresh_rollouts():
    out = subprocess.run([sys.executable, str(REPO / "bench" / "spec_rollout.py"), "--tiny", "--train-rounds", "3"],
                         capture_output=True, text=True, timeout=600, cwd=REPO, check=True)
    result = json.loads(out.stdout)
    assert result["draft_train_rounds"] == 3 and len(result["accept_len_per_round"]) == 3
    assert all(1.0 <= length <= 1 + result["num_steps"] for length in result["accept_len_per_round"])
    assert result["draft_loss_first_last"][1] < result["draft_loss_first_last"][0]  # the draft learns
    assert result["plain_tok_per_s"] > 0 and result["spec_tok_per_s"] > 0
    assert out.stderr.count("] round ") == 3
