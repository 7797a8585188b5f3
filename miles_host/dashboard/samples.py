"""Per-step samples for the dashboard's rollout browser, one JSONL file a step.

``<output_dir>/dashboard/samples/step_<rollout_id>.jsonl`` holds the first whole groups of
the step, up to ``--miles-dashboard-samples-per-step`` samples, one JSON object each: the
prompt, the response, its reward, and per response token its id, its text, the rollout's
log-prob, the trainer's log-prob of the same token (trainer processes send theirs to the
driver: :mod:`miles_host.distributed.sample_details`),
the loss mask and, with routing replay, the share of MoE layers whose replayed experts the
training router chose as well. Floats keep 9 significant digits, what a float32 needs to
round-trip, so a train-rollout difference of one float32 ulp still shows (the file is for
looking at, not for replay: ``--dump-rollouts`` writes full samples).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

#: Sample.metadata keys the trainer and the routing-replay plugin fill for the dashboard
TRAIN_LOG_PROBS_KEY = "train_log_probs"
EXPERT_AGREEMENT_KEY = "routed_expert_agreement"


def samples_dir(output_dir: str | Path) -> Path:
    """Where a run's dashboard sample files go."""
    return Path(output_dir) / "dashboard" / "samples"


def step_file(output_dir: str | Path, rollout_id: int) -> Path:
    """The sample file of one rollout step."""
    return samples_dir(output_dir) / f"step_{rollout_id:05d}.jsonl"


def record_train_log_probs(samples: Sequence[Any], log_probs: Any, response_lengths: Sequence[int]) -> None:
    """Keep each sample's training log-probs (a packed ``[sum(response_lengths)]`` tensor) in
    its metadata for the dashboard (one host read per micro-batch)."""
    values = log_probs.detach().float().cpu().tolist()
    start = 0
    for sample, length in zip(samples, response_lengths):
        sample.metadata[TRAIN_LOG_PROBS_KEY] = values[start : start + int(length)]
        start += int(length)


def _round(values: Sequence[float] | None) -> list[float] | None:
    return None if values is None else [float(f"{float(v):.9g}") for v in values]


def reward_or_none(sample: Any, scalar: Callable[[Any], float]) -> float | None:
    """The sample's scalar reward, None where it has none (a failed sample)."""
    try:
        return scalar(sample.reward)
    except (TypeError, ValueError):
        return None


def sample_record(sample: Any, tokenizer: Any, scalar: Callable[[Any], float]) -> dict:
    """The dashboard's JSON object of one sample (its training log-probs taken out of its metadata)."""
    length = sample.response_length
    response_ids = list(sample.tokens[len(sample.tokens) - length :]) if length else []
    agreement = sample.metadata.pop(EXPERT_AGREEMENT_KEY, None)
    return {
        "index": sample.index,
        "group_index": sample.group_index,
        "status": getattr(sample.status, "value", str(sample.status)),
        "reward": reward_or_none(sample, scalar),
        "prompt": sample.prompt if isinstance(sample.prompt, str) else json.dumps(sample.prompt),
        "response": sample.response,
        "prompt_length": len(sample.tokens) - length,
        "weight_versions": list(sample.weight_versions),
        "tokens": response_ids,
        "token_text": tokenizer.batch_decode([[token] for token in response_ids]) if response_ids else [],
        "rollout_log_probs": _round(sample.rollout_log_probs),
        "train_log_probs": _round(sample.metadata.pop(TRAIN_LOG_PROBS_KEY, None)),
        "loss_mask": list(sample.loss_mask) if sample.loss_mask is not None else [1] * length,
        EXPERT_AGREEMENT_KEY: _round(agreement),
    }


def first_groups(groups: Sequence[Sequence[Any]], limit: int) -> list[Any]:
    """The samples of the first whole groups that fit in ``limit`` (at least one group when ``limit`` > 0)."""
    chosen: list[Any] = []
    for group in groups:
        if chosen and len(chosen) + len(group) > limit:
            break
        chosen.extend(group)
        if len(chosen) >= limit:
            break
    return chosen if limit > 0 else []


def write_step_samples(output_dir: str | Path, rollout_id: int, groups: Sequence[Sequence[Any]], tokenizer: Any,
                       scalar: Callable[[Any], float], limit: int) -> Path | None:
    """Write one step's sample file (replacing it whole); None when there is nothing to write.
    A failed write is warned about and the run goes on (the file is for looking at)."""
    chosen = first_groups(groups, limit)
    written = {id(sample) for sample in chosen}
    for group in groups:  # training log-probs of samples not written are dropped as well
        for sample in group:
            if id(sample) not in written:
                sample.metadata.pop(TRAIN_LOG_PROBS_KEY, None)
                sample.metadata.pop(EXPERT_AGREEMENT_KEY, None)
    if not chosen:
        return None
    path = step_file(output_dir, rollout_id)
    partial = path.with_suffix(".jsonl.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with partial.open("w") as handle:
            for sample in chosen:
                handle.write(json.dumps(sample_record(sample, tokenizer, scalar)) + "\n")
        partial.replace(path)
    except OSError as error:
        with contextlib.suppress(OSError):
            partial.unlink()
        print(f"miles: warning: the dashboard's samples of rollout {rollout_id} could not be written to {path} "
              f"({error.strerror or error}); the run continues", file=sys.stderr)
        return None
    return path
