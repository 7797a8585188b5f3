"""Acceptance (CPU float32): with ``--true-on-policy`` the trainer's recomputed
log-probs equal the engine's rollout log-probs bit for bit over GRPO steps with
mixed prompt lengths, partial batches and micro-batching, dense and MoE."""

from __future__ import annotations

import json
import math
from pathlib import Path

from miles_host.cli.main import main

from tests.true_on_policy.conftest import QUICKSTART_MODEL

DIFF = "train/train_rollout_logprob_abs_diff"
DIFF_MAX = "train/train_rollout_logprob_abs_diff_max"


def grpo_rows(model: Path, data: Path, out: Path, *extra: str) -> list[dict]:
    args = [
        "run", "--hf-checkpoint", str(model), "--prompt-data", str(data),
        "--input-key", "input", "--label-key", "label", "--rm-type", "exact",
        "--advantage-estimator", "grpo", "--rollout-batch-size", "3", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "5", "--rollout-temperature", "1.0", "--rollout-shuffle",
        "--num-rollout", "2", "--lr", "5e-4", "--device", "cpu", "--dtype", "float32",
        "--output-dir", str(out), "--no-progress", *extra,
    ]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if DIFF in r]
    assert len(rows) == 2, rows
    return rows


def test_dense_quickstart_is_exactly_on_policy(mixed_data, tmp_path):
    # 12 samples in micro-batches of 5 (the last one partial); over-sampled prompts whose
    # groups are filtered or aborted once the batch is full; at most 6 sequences per engine step
    rows = grpo_rows(
        QUICKSTART_MODEL, mixed_data, tmp_path, "--true-on-policy", "--micro-batch-size", "5",
        "--over-sampling-batch-size", "4", "--rollout-max-num-seqs", "6",
    )
    for row in rows:
        assert row[DIFF] == 0.0 and row[DIFF_MAX] == 0.0, row
        assert row["train/train_rollout_kl"] == 0.0
        # the first (only) PPO step of each rollout: ratio exactly 1
        assert row["train/ppo_kl"] == 0.0 and row["train/pg_clipfrac"] == 0.0


def test_moe_is_exactly_on_policy_with_dynamic_micro_batches(moe_policy, mixed_data, tmp_path):
    rows = grpo_rows(
        moe_policy, mixed_data, tmp_path, "--true-on-policy",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "40",
    )
    for row in rows:
        assert row[DIFF] == 0.0 and row[DIFF_MAX] == 0.0, row
        assert row["train/ppo_kl"] == 0.0


def test_without_the_flag_the_mismatch_is_measured_and_logged(mixed_data, tmp_path):
    rows = grpo_rows(QUICKSTART_MODEL, mixed_data, tmp_path, "--micro-batch-size", "5")
    for row in rows:
        assert math.isfinite(row[DIFF]) and row[DIFF] >= 0.0
        assert math.isfinite(row[DIFF_MAX]) and row[DIFF_MAX] >= row[DIFF]
        assert row[DIFF_MAX] < 1e-3  # same kernels, batch shapes only: tiny
    print(f"\nwithout --true-on-policy: abs diff mean {[r[DIFF] for r in rows]}, max {[r[DIFF_MAX] for r in rows]}")


def test_moe_with_routing_replay_is_exactly_on_policy(moe_policy, mixed_data, tmp_path):
    # R3 captures the routes per token in the invariant engine and replays them per token in training
    rows = grpo_rows(moe_policy, mixed_data, tmp_path, "--true-on-policy", "--plugins", "r3", "--micro-batch-size", "4")
    for row in rows:
        assert row[DIFF] == 0.0 and row[DIFF_MAX] == 0.0, row
        assert row.get("r3/expert_agreement", 1.0) == 1.0


def test_bf16_engine_with_float32_master_weights_is_exactly_on_policy(moe_policy, mixed_data, tmp_path):
    """The GPU dtype flow on CPU: the engine in bf16, the trainer's master weights in float32.
    With the flag the trainer's forward runs on the weights cast as the engine loads them."""
    for name, model, extra in (
        ("dense", QUICKSTART_MODEL, ("--micro-batch-size", "5")),
        ("moe", moe_policy, ("--use-dynamic-batch-size", "--max-tokens-per-gpu", "40")),
    ):
        out = tmp_path / name
        out.mkdir()
        rows = grpo_rows(model, mixed_data, out, "--true-on-policy", "--dtype", "bfloat16", *extra)
        for row in rows:
            assert row[DIFF] == 0.0 and row[DIFF_MAX] == 0.0, (name, row)
            assert row["train/ppo_kl"] == 0.0
    # without the flag the bf16 engine and the float32 trainer differ (what the flag removes)
    out = tmp_path / "dense_off"
    out.mkdir()
    rows = grpo_rows(QUICKSTART_MODEL, mixed_data, out, "--dtype", "bfloat16", "--micro-batch-size", "5")
    assert all(row[DIFF] > 0.0 for row in rows)
    print(f"\nbf16 engine, float32 trainer, no flag: abs diff mean {[r[DIFF] for r in rows]}, max {[r[DIFF_MAX] for r in rows]}")
