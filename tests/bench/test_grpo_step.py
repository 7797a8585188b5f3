"""``bench/grpo_step.py --fully-async``: miles' synchronous step against ``FullyAsyncRun``'s,
and the comparison's arithmetic."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")


def test_async_comparison_arithmetic():
    from bench.grpo_step import async_comparison

    sync = {"step_s": 10.0, "rollout_s": 6.0, "train_s": 4.0, "rollout_tok_per_s": 1000.0}
    fa = {"step_s": 7.0, "rollout_s": 1.0, "train_s": 5.0, "rollout_tok_per_s": 800.0, "trainer_idle_s": 1.0,
          "engine_idle_s": 0.5, "avg_staleness": 1.0}
    cmp = async_comparison(sync, fa)
    assert cmp["ratio"] == pytest.approx(0.7)
    assert cmp["goal_met"] is True
    # 6 + 4 - 7 = 3 seconds hidden, of the shorter phase's 4
    assert cmp["overlap"] == pytest.approx(0.75)
    assert cmp["generation_speed_vs_sync"] == pytest.approx(0.8)
    assert cmp["train_time_vs_sync"] == pytest.approx(1.25)
    assert async_comparison(sync, {**fa, "step_s": 8.0})["goal_met"] is False


@pytest.mark.slow
def test_tiny_sync_vs_fully_async_in_one_process(tmp_path):
    from bench import grpo_step

    out = tmp_path / "result.json"
    results = grpo_step.main(["--tiny", "--only", "miles", "--fully-async", "--steps", "3",
                              "--workdir", str(tmp_path), "--result-json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    sync, fa, cmp = results["miles"], results["miles_async"], results["async_vs_sync"]
    for run in (sync, fa):
        assert run["step_s"] > 0 and run["train_s"] > 0 and run["response_len"] == 16
    # the asynchronous run's rollout time is the trainer's wait for its batch
    assert fa["trainer_idle_s"] == fa["rollout_s"] >= 0
    assert fa["engine_idle_s"] >= 0
    # the producer generates ahead: steps after the first train groups of older weights, never
    # more than the steps run
    assert 0 <= fa["avg_staleness"] <= 3
    assert cmp["ratio"] == pytest.approx(fa["step_s"] / sync["step_s"])
    shorter = min(sync["rollout_s"], sync["train_s"])
    assert cmp["overlap"] == pytest.approx((sync["rollout_s"] + sync["train_s"] - fa["step_s"]) / shorter)


def test_busy_seconds_counts_overlapping_kernels_once():
    from bench.grpo_step import busy_seconds

    # [0, 3] and [2, 5] overlap (5 us busy), [7, 8] apart, [7.5, 7.8] inside it: 6 us
    assert busy_seconds([(7.0, 8.0), (0.0, 3.0), (2.0, 5.0), (7.5, 7.8)]) == pytest.approx(6e-6)
    assert busy_seconds([]) == 0.0
