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
