"""The wandb (offline) and TensorBoard loggers with the real packages: their files hold the
metrics metrics.jsonl holds, read back with wandb's protobuf records and TensorBoard's
EventAccumulator."""

from __future__ import annotations

import math
import random

import pytest

from miles_host.config import MilesConfig
from miles_host.logging_backends import JsonlLogger, TensorBoardLogger, WandbLogger, tensorboard_dir
from tests.dashboard.conftest import read_metrics, step_record
from tests.dashboard.wandb_records import history_rows


def logged_records() -> list[dict]:
    """What a run logs: the evaluation before training (rollout -1), steps with ints, a NaN, evals."""
    rng = random.Random(3)
    return [{"rollout_id": -1, "eval/gsm8k/accuracy": 0.25}, *[step_record(i, rng) for i in range(4)]]


def expected_points(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """metric -> [(rollout_id, value)] of metrics.jsonl ("nan" as written by the jsonl logger: NaN)."""
    points: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for key, value in record.items():
            if key != "rollout_id":
                points.setdefault(key, []).append((record["rollout_id"], float(value)))
    return points


def same(a: list[tuple[int, float]], b: list[tuple[int, float]], rel: float) -> bool:
    return len(a) == len(b) and all(
        sa == sb and ((math.isnan(va) and math.isnan(vb)) or va == pytest.approx(vb, rel=rel, abs=1e-12))
        for (sa, va), (sb, vb) in zip(a, b))


def log_all(loggers, records) -> None:
    for record in records:
        for logger in loggers:
            logger.log(record, record["rollout_id"])
    for logger in loggers:
        logger.close()


def test_tensorboard_events_hold_the_jsonl_metrics(tmp_path, monkeypatch):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                            reason="tensorboard is not installed")
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    config = MilesConfig(output_dir=str(tmp_path), use_tensorboard=True, tb_project_name="p")
    log_all([JsonlLogger(config), TensorBoardLogger(config)], logged_records())
    expected = expected_points(read_metrics(tmp_path))
    events = event_accumulator.EventAccumulator(str(tensorboard_dir(config)), size_guidance={"scalars": 0})
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(expected)
    for tag, points in expected.items():
        stored = [(event.step, event.value) for event in events.Scalars(tag)]
        assert same(stored, points, rel=1e-6), tag  # TensorBoard keeps float32


def test_wandb_offline_run_holds_the_jsonl_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = MilesConfig(output_dir=str(tmp_path), use_wandb=True, wandb_mode="offline", wandb_project="miles-test")
    log_all([JsonlLogger(config), WandbLogger(config)], logged_records())
    expected = expected_points(read_metrics(tmp_path))
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    rows = history_rows(run_dir)
    assert [row["rollout_id"] for row in rows] == [-1, 0, 1, 2, 3]  # the rollout -1 evaluation is kept
    stored: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "rollout_id" and not key.startswith("_"):  # wandb's own _step, _runtime, _timestamp
                stored.setdefault(key, []).append((row["rollout_id"], float(value)))
    assert sorted(stored) == sorted(expected)
    for key, points in expected.items():
        assert same(stored[key], points, rel=0), key
