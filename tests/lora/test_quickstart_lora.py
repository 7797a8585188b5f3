"""LoRA GRPO on the shipped quickstart: rank-2 adapters on every linear (under 5% of the
parameters) take the addition task from the base model's eval accuracy to >= 80%."""

from __future__ import annotations

import json

import pytest

from miles_host.cli.main import main


@pytest.mark.slow
def test_lora_grpo_on_the_quickstart_learns_training_under_5_percent(tmp_path, capsys):
    assert main(["run", "--output-dir", str(tmp_path), "--lora-rank", "2", "--no-progress"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["eval/addition/accuracy"] for r in rows if "eval/addition/accuracy" in r]
    print(f"\nLoRA quickstart eval accuracy: {accuracy}")
    assert accuracy[0] <= 0.40 and accuracy[-1] >= 0.80
    trained = [r for r in rows if "lora/trainable_fraction" in r]
    assert trained and all(r["lora/trainable_fraction"] < 0.05 for r in trained)
    assert "trainable of" in capsys.readouterr().err  # the count is logged at start too


@pytest.mark.slow
def test_lora_grpo_with_adapter_sync_learns_moving_only_the_adapters(tmp_path, capsys):
    """``--lora-sync adapter``: the engine runs the adapters unmerged; after the first sync
    every step moves the adapter tensors alone, and the run learns as with merged syncs."""
    assert main(["run", "--output-dir", str(tmp_path), "--lora-rank", "2", "--lora-sync", "adapter",
                 "--no-progress"]) == 0
    err = capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["eval/addition/accuracy"] for r in rows if "eval/addition/accuracy" in r]
    synced = [r["perf/weight_sync_bytes"] for r in rows if "perf/weight_sync_bytes" in r]
    first = err.split("first weight sync sent the base and adapters (")[1].split(")")[0]
    print(f"\nLoRA adapter-sync quickstart: {len(rows)} steps, eval accuracy {accuracy}; first sync {first}, "
          f"then bytes per step {sorted(set(synced))}")
    assert accuracy[0] <= 0.40 and accuracy[-1] >= 0.80
    steps = [r for r in rows if r["rollout_id"] >= 0]
    assert len(synced) == len(steps) and len(set(synced)) == 1  # the same adapter tensors at every step
    assert "later weight syncs send the adapters only" in err


@pytest.mark.slow
def test_lora_grpo_over_an_int4_base_learns_syncing_only_the_adapters(tmp_path, capsys):
    """``--plugins int4 --int4-target all``: the engine's linears hold INT4 weights (group 32, the
    quickstart's 64-wide inputs), the trainer fake-quantizes the frozen base (QAT), rank-2
    adapters over both; the run learns and every step after the first sync moves the adapters alone."""
    assert main(["run", "--output-dir", str(tmp_path), "--plugins", "int4", "--int4-target", "all",
                 "--int4-group-size", "32", "--lora-rank", "2", "--lora-sync", "adapter", "--no-progress"]) == 0
    err = capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["eval/addition/accuracy"] for r in rows if "eval/addition/accuracy" in r]
    synced = {r["perf/weight_sync_bytes"] for r in rows if r["rollout_id"] >= 0}
    print(f"\nLoRA over INT4 quickstart: eval accuracy {accuracy}, bytes per step {sorted(synced)}")
    assert accuracy[0] <= 0.40 and accuracy[-1] >= 0.80
    assert len(synced) == 1 and "later weight syncs send the adapters only" in err
