"""The README's first command: ``miles run`` with no arguments learns the task."""

from __future__ import annotations

import json

import pytest

from miles_host.cli.main import main
from miles_host.quickstart_preset import wants_quickstart


@pytest.mark.slow
def test_quickstart_learns_from_at_most_40_to_at_least_80_percent(tmp_path, capsys):
    assert main(["run", "--output-dir", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["eval/addition/accuracy"] for r in rows if "eval/addition/accuracy" in r]
    err = capsys.readouterr().err
    print(f"\nquickstart eval accuracy: {accuracy}")
    assert accuracy[0] <= 0.40 and accuracy[-1] >= 0.80
    assert "eval after 0 rollout(s): addition accuracy" in err and "eval after 30 rollout(s)" in err and len(accuracy) == 7
    assert (tmp_path / "curves.png").is_file()


def test_quickstart_preset_only_without_own_model_or_data():
    assert wants_quickstart([]) and wants_quickstart(["--lr", "1e-4"])
    assert not wants_quickstart(["--hf-checkpoint", "x"]) and not wants_quickstart(["--config=run.yaml"])
