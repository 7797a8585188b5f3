"""Summarise a ``miles run`` output directory: final eval accuracy and per-phase timing.

    python3 bench/run_summary.py OUTPUT_DIR [--skip 1]

Means over the steps after ``--skip`` warm-up steps (CUDA graphs, allocator, NCCL set-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

TIMES = ("step_time_s", "rollout_time_s", "train_time_s", "weight_sync_time_s", "phase_switch_time_s")


def _rollouts_done(row: dict) -> int:
    """Rollouts trained on when the row's eval ran (a step's row evaluates after its own)."""
    rollout_id = row.get("rollout_id", -1)
    return max(0, rollout_id + 1 if "perf/step_time_s" in row else rollout_id)


def summary(directory: Path, skip: int) -> str:
    rows = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r.get("rollout_id", -1) >= 0 and "perf/step_time_s" in r]
    evals = [(_rollouts_done(r), k.split("/")[1], v) for r in rows for k, v in r.items() if k.startswith("eval/")]
    lines = [f"{directory}: {len(steps)} steps"]
    if evals:
        (first_n, name, first), (last_n, _, last) = evals[0], evals[-1]
        lines.append(f"  eval {name} accuracy: {first:.1%} after {first_n} rollout(s) -> {last:.1%} after {last_n}")
    timed = steps[skip:] or steps
    for name in TIMES:
        values = [r[f"perf/{name}"] for r in timed if f"perf/{name}" in r]
        if values:
            lines.append(f"  {name:<22} mean {statistics.mean(values):8.3f}  max {max(values):8.3f}  (steps {skip}..)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the means")
    args = parser.parse_args(argv)
    print(summary(args.directory, args.skip))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
