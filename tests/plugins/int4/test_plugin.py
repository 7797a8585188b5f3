"""The plugin through the host: registration, the flags, and a quickstart run that learns."""

from __future__ import annotations

import json

import pytest

from miles_host.cli.main import main, plugin_commands
from miles_host.plugin_manager import MilesPluginManager


def test_registers_the_int4_precision_and_commands():
    manager = MilesPluginManager()
    manager.discover()
    manager.activate(selected=["int4"])
    precision = manager.registries.precisions.get("int4")
    assert precision.prepare_train_model and precision.prepare_rollout_model and precision.convert_for_rollout
    commands = plugin_commands(manager)
    assert "memory" in set(commands)


def test_bad_flag_values_are_usage_errors(tmp_path, capsys):
    from miles_int4.settings import int4_settings
    from tests.plugins.int4.conftest import Flags

    with pytest.raises(ValueError, match="--int4-group-size must be one of"):
        int4_settings(Flags(group_size=48))
    with pytest.raises(ValueError, match="--int4-target must be one of"):
        int4_settings(Flags(target="attention"))


@pytest.mark.slow
def test_quickstart_learns_with_int4(tmp_path, capsys):
    """The shipped quickstart (dense, hidden 64) with every linear INT4 (group 32) still learns addition."""
    out = tmp_path / "run"
    argv = ["run", "--output-dir", str(out), "--plugins", "int4", "--int4-target", "all", "--int4-group-size", "32",
            "--num-rollout", "5", "--no-progress"]
    assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["precision"] == "int4" and config["plugin_args"]["int4_target"] == "all"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["eval/addition/accuracy"] for r in rows if "eval/addition/accuracy" in r]
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in rows if "train/train_rollout_logprob_abs_diff" in r]
    print(f"\nint4 quickstart eval accuracy {accuracy}; train-rollout |logprob diff| max {max(diffs):.2e}")
    assert accuracy[0] <= 0.40 and accuracy[-1] >= 0.80
    assert max(diffs) < 1e-4  # the rollout samples what the QAT forward computes


def test_quickstart_runs_with_the_packed_int4_rollout(tmp_path):
    """The packed path (torch's CPU int4 kernel) through a real loop: its weights arrive by weight
    sync into the modules' sinks each step, and the rollout still samples what training computes."""
    out = tmp_path / "run"
    argv = ["run", "--output-dir", str(out), "--plugins", "int4", "--int4-target", "all", "--int4-group-size", "32",
            "--int4-rollout-gemm", "packed", "--num-rollout", "2", "--no-progress", "--eval-interval", "100"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in rows if "train/train_rollout_logprob_abs_diff" in r]
    assert len(diffs) == 2 and max(diffs) < 1e-3  # the kernel accumulates in its own order
