"""Debug replay: dump each step's samples, train on them later without a rollout engine.

slime's ``--save-debug-rollout-data`` / ``--load-debug-rollout-data``
(``slime/observability/rollout_data_utils.py``): the path is a template formatted with
``rollout_id``, the file a ``torch.save`` of ``{"rollout_id": ..., "samples": [sample
dicts]}``. miles adds the step's groups (each sample's ``group_index``, kept as it was)
and its rollout counts under ``"miles_stats"``, so a replayed step reports the same
``rollout/*`` counts and trains on exactly the same samples as the original step.

``--save-debug-train-data`` (slime's, formatted with ``rollout_id`` and ``rank``) writes what a
step trained on: ``{"rollout_id", "rank", "rollout_data"}`` with slime's per-sample lists
(``tokens``, ``response_lengths``, ``total_lengths``, ``loss_masks``, ``rewards``,
``rollout_log_probs``) and ``log_probs``, the trainer's log-probs of each sample's response
tokens (trainers in worker processes send theirs back to the driver's samples:
:mod:`miles_host.distributed.sample_details`). The driver holds the whole batch, so it
writes one file, rank 0. ``--dump-details DIR`` sets both
templates under ``DIR`` as slime does.

``--debug-train-only`` runs without an engine: :class:`NoEngine` stands in for the
rollout backend and refuses every generation request with a message saying why.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from miles_host.dashboard.samples import TRAIN_LOG_PROBS_KEY, reward_or_none
from miles_host.protocols import RolloutBackendBase
from miles_host.rollout_manager import RolloutStats
from miles_host.sample import Sample


def debug_path(template: str, rollout_id: int | str) -> Path:
    """The file of ``rollout_id`` under a ``{rollout_id}`` path template."""
    return Path(template.format(rollout_id=rollout_id))


def rollout_data_template(config: Any) -> str | None:
    """``--save-debug-rollout-data``, else ``--dump-details``' ``rollout_data/{rollout_id}.pt``."""
    if config.save_debug_rollout_data or not config.dump_details:
        return config.save_debug_rollout_data
    return str(Path(config.dump_details) / "rollout_data" / "{rollout_id}.pt")


def train_data_template(config: Any) -> str | None:
    """``--save-debug-train-data``, else ``--dump-details``' ``train_data/{rollout_id}_{rank}.pt``."""
    if config.save_debug_train_data or not config.dump_details:
        return config.save_debug_train_data
    return str(Path(config.dump_details) / "train_data" / "{rollout_id}_{rank}.pt")


def keeps_train_log_probs(config: Any) -> bool:
    """Whether the trainer keeps each sample's log-probs in its metadata: for the dashboard's
    rollout browser or the train-data dump."""
    return bool(config.use_miles_dashboard or train_data_template(config))


def save_debug_train_data(template: str, rollout_id: int, samples: list[Sample],
                          scalar: Callable[[Any], float]) -> Path:
    """Write what the step trained on (slime's ``rollout_data`` lists, the trainer's log-probs
    read from each sample's metadata, where the dashboard's writer takes them); the path written."""
    path = Path(template.format(rollout_id=rollout_id, rank=0))
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "tokens": [list(s.tokens) for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "total_lengths": [len(s.tokens) for s in samples],
        "loss_masks": [list(s.loss_mask) if s.loss_mask is not None else [1] * s.response_length for s in samples],
        "rewards": [reward_or_none(s, scalar) for s in samples],
        "rollout_log_probs": [list(s.rollout_log_probs) if s.rollout_log_probs is not None else None for s in samples],
        "log_probs": [s.metadata.get(TRAIN_LOG_PROBS_KEY) for s in samples],
        "sample_indices": [s.index for s in samples],
    }
    torch.save({"rollout_id": rollout_id, "rank": 0, "rollout_data": data}, path)
    return path


def save_debug_rollout_data(template: str, rollout_id: int, groups: list[list[Sample]], stats: RolloutStats) -> Path:
    """Write the step's samples (slime's format, plus ``miles_stats``); the path written."""
    path = debug_path(template, rollout_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    counts = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats) if f.name != "extra"}
    payload = {
        "rollout_id": rollout_id,
        "samples": [sample.to_dict() for group in groups for sample in group],
        "miles_stats": counts,
    }
    torch.save(payload, path)
    print(f"miles: saved rollout {rollout_id}'s {len(payload['samples'])} samples to {path}", file=sys.stderr)
    return path


def subsample(samples: list[Sample], fraction: float | None) -> list[Sample]:
    """slime's ``--load-debug-rollout-data-subsample``: the first and last halves of
    ``fraction`` of the rows."""
    if fraction is None:
        return samples
    keep = int(len(samples) * fraction)
    return samples[: keep // 2] + samples[len(samples) - keep // 2 :] if keep // 2 else []


def load_debug_rollout_data(template: str, rollout_id: int, fraction: float | None = None
                            ) -> tuple[list[list[Sample]], RolloutStats]:
    """The groups and counts saved for ``rollout_id`` (FileNotFoundError naming the path and flag)."""
    path = debug_path(template, rollout_id)
    if not path.is_file():
        raise FileNotFoundError(
            f"--load-debug-rollout-data {template}: no file {path} for rollout {rollout_id} (written by "
            "--save-debug-rollout-data); give the same template, and --num-rollout at most the rollouts saved")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    try:
        samples = [Sample.from_dict(data) for data in payload["samples"]]
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"--load-debug-rollout-data {path}: not a rollout saved by miles ({error})") from None
    samples = subsample(samples, fraction)
    groups: list[list[Sample]] = []
    for sample in samples:
        if groups and sample.group_index is not None and groups[-1][0].group_index == sample.group_index:
            groups[-1].append(sample)
        else:
            groups.append([sample])
    stats = RolloutStats(**payload.get("miles_stats", {}))
    if fraction is not None or "miles_stats" not in payload:
        stats.finished_samples = len(samples)
    return groups, stats


class NoEngine(RolloutBackendBase):
    """The rollout backend of ``--debug-train-only``: no engine started; a generation request is an error."""

    weight_version: Any = 0

    def submit(self, rid: str, input_ids: list[int], sampling_params: dict, return_routed_experts: bool = False) -> None:
        raise ValueError("--debug-train-only (or --load-debug-rollout-data): no rollout engine was started, so "
                         "nothing can be generated; drop the flag to generate")

    def step(self) -> list[dict]:
        return []

    def has_unfinished(self) -> bool:
        return False

    def abort_all(self) -> list[dict]:
        return []

    def update_weights(self, named_tensors: Any, weight_version: Any = None) -> Any:
        self.weight_version = weight_version
        return weight_version
