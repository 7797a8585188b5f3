"""``bench/moe_train.py --tiny``: every row of the MoE training bench runs on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import moe_train  # noqa: E402


@pytest.mark.slow
def test_tiny_moe_train_bench_runs_every_row(tmp_path):
    results = moe_train.main(["--tiny", "--warmup", "0", "--steps", "1", "--json", str(tmp_path / "out.json")])
    assert set(results) == {"miles grouped", "miles loop", "transformers grouped_mm", "transformers eager"}
    # same weights and batch: the two miles paths compute the same loss
    assert results["miles grouped"]["loss"] == pytest.approx(results["miles loop"]["loss"], rel=1e-5)
    assert all(r["tokens_per_s"] > 0 for r in results.values())
    assert (tmp_path / "out.json").exists()
