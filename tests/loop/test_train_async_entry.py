"""``python train_async.py <flags>`` (slime's asynchronous entry point) is ``miles run --fully-async <flags>``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def dry_run_config(tiny_task, *extra: str) -> dict:
    model, data = tiny_task
    argv = [sys.executable, str(REPO / "train_async.py"), "--hf-checkpoint", str(model), "--prompt-data", str(data),
            "--label-key", "label", "--rm-type", "exact", "--dry-run", *extra]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout[result.stdout.index("{"):])


@pytest.mark.parametrize("extra", [(), ("--fully-async",)])
def test_train_async_runs_fully_async(tiny_task, extra):
    config = dry_run_config(tiny_task, *extra)
    resolved = config.get("config", config)
    assert resolved["fully_async"] is True
