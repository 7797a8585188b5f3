"""Reading run output directories for the dashboard: metrics from a byte offset (live
tailing), the rollout browser's sample files, and each step's phase timeline."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_host.dashboard.samples import samples_dir, step_file

#: the timeline's phases: name -> the timing metric (seconds) it is read from. Rewards are
#: scored while the rollout generates, so "generate" is the rollout time less the reward time.
PHASE_METRICS = {
    "generate": "perf/rollout_time_s",
    "reward": "perf/reward_time_s",
    "teacher": "perf/opd_teacher_time_s",
    "train": "perf/train_time_s",
    "sync": "perf/weight_sync_time_s",
    "offload": "perf/phase_switch_time_s",
    "eval": "perf/eval_time_s",
}
#: phases measured inside another phase's time: (inner, outer)
NESTED_PHASES = (("reward", "generate"),)
STEP_TIME_METRIC = "perf/step_time_s"


@dataclass
class RunDir:
    """One run's output directory, as the dashboard reads it."""

    run_id: str
    path: Path

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    def summary(self) -> dict[str, Any]:
        """Name, path, size of metrics.jsonl, steps with samples, and a few of the run's settings."""
        config = {}
        config_path = self.path / "config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except (OSError, json.JSONDecodeError):
                config = {}
        keys = ("hf_checkpoint", "advantage_estimator", "rollout_batch_size", "n_samples_per_prompt", "lr", "plugins")
        return {
            "id": self.run_id,
            "name": self.path.name,
            "path": str(self.path),
            "metrics_bytes": self.metrics_path.stat().st_size if self.metrics_path.is_file() else 0,
            "sample_steps": self.sample_steps(),
            "config": {key: config.get(key) for key in keys if key in config},
        }

    def metrics_since(self, offset: int) -> dict[str, Any]:
        """The whole lines of metrics.jsonl after byte ``offset``, and the offset after them
        (a line still being written is left for the next call)."""
        if not self.metrics_path.is_file():
            return {"records": [], "offset": 0}
        with self.metrics_path.open("rb") as handle:
            size = handle.seek(0, 2)
            if offset > size:  # the file was replaced (a fresh run in the same directory): start over
                offset = 0
            handle.seek(offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1
        records = [_finite(json.loads(line)) for line in data[:end].splitlines() if line.strip()]
        return {"records": records, "offset": offset + end}

    def sample_steps(self) -> list[int]:
        """Rollout steps that have a sample file."""
        folder = samples_dir(self.path)
        if not folder.is_dir():
            return []
        return sorted(int(p.stem.split("_")[1]) for p in folder.glob("step_*.jsonl"))

    def samples(self, rollout_id: int) -> list[dict]:
        """The sample records of one step (FileNotFoundError when it has none)."""
        path = step_file(self.path, rollout_id)
        if not path.is_file():
            raise FileNotFoundError(f"run {self.run_id} has no samples of rollout {rollout_id} ({path})")
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def timeline(self) -> list[dict[str, Any]]:
        """Each step's phases in seconds (:data:`PHASE_METRICS`), and ``other``: the rest of the
        step's time (evaluation, the loop's own work)."""
        records = self.metrics_since(0)["records"]
        return [step_phases(record) for record in records if record.get("rollout_id", -1) >= 0
                and STEP_TIME_METRIC in record]


def step_phases(record: dict) -> dict[str, Any]:
    """One metrics record's phase durations (seconds, in :data:`PHASE_METRICS` order)."""
    phases = {name: float(record[key]) for name, key in PHASE_METRICS.items() if isinstance(record.get(key), (int, float))}
    for inner, outer in NESTED_PHASES:
        if inner in phases and outer in phases:
            phases[outer] = max(phases[outer] - phases[inner], 0.0)
    total = float(record[STEP_TIME_METRIC])
    phases["other"] = max(total - sum(phases.values()), 0.0)
    return {"rollout_id": record["rollout_id"], "step_time_s": total, "phases": phases}


def _finite(record: dict) -> dict:
    """JSON has no NaN or infinity: the jsonl logger writes them as strings; the page gets null."""
    return {key: (None if isinstance(value, float) and not math.isfinite(value) else value)
            for key, value in record.items()}


def find_runs(paths: list[str | Path]) -> list[RunDir]:
    """The run directories under ``paths``: each path that holds metrics.jsonl or config.json,
    else its sub-directories that do. FileNotFoundError for a path that does not exist."""
    runs: list[RunDir] = []
    for given in paths:
        path = Path(given)
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is not a directory: give run output directories (--output-dir of "
                                    "miles run) or folders holding them")
        candidates = [path] if _is_run(path) else sorted(p for p in path.iterdir() if p.is_dir() and _is_run(p))
        for candidate in candidates:
            runs.append(RunDir(_unique_id(candidate.name, runs), candidate.resolve()))
    return runs


def _is_run(path: Path) -> bool:
    return (path / "metrics.jsonl").is_file() or (path / "config.json").is_file()


def _unique_id(name: str, runs: list[RunDir]) -> str:
    taken = {run.run_id for run in runs}
    run_id, n = name, 1
    while run_id in taken:
        n += 1
        run_id = f"{name}-{n}"
    return run_id
