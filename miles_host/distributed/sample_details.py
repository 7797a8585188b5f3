"""Per-sample values that trainers in worker processes send back to the driver's samples.

A trainer keeps, in each sample's ``metadata``, what the dashboard's rollout browser and the
train-data dump (``--save-debug-train-data`` / ``--dump-details``) show: the trainer's
log-probs of the response tokens and, with routing replay, the per-token routed-expert
agreement (:data:`DETAIL_KEYS`). A trainer rank in another process trains on copies of the
driver's samples (they went through a pipe), so what it writes stays in its copies: it
takes the values out of them (:func:`take_details`, keyed by each sample's position in the
list the driver sent) and returns them; the driver puts them into its own samples
(:func:`put_details`) before the dashboard and dump writers read them.

Only when :func:`~miles_host.debug_rollout.keeps_train_log_probs` is true do trainers keep
these values, so otherwise nothing is sent. Which rank has a sample's values: the one
data-parallel rank that trained on it, and under pipeline parallelism its last stage; the
tensor-parallel ranks of that stage compute the same values, and the first answer a sample
gets is kept (the driver's own rank first, then the workers in rank order).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from miles_host.dashboard.samples import EXPERT_AGREEMENT_KEY, TRAIN_LOG_PROBS_KEY

#: the metadata keys carried from a trainer rank to the driver's samples
DETAIL_KEYS = (TRAIN_LOG_PROBS_KEY, EXPERT_AGREEMENT_KEY)

#: ``{position in the driver's list: {metadata key: per-token values}}``
SampleDetails = dict[int, dict[str, Any]]


def take_details(samples: Sequence[Any]) -> SampleDetails:
    """The :data:`DETAIL_KEYS` values of ``samples``, taken out of their metadata, by position
    (samples that have none are left out)."""
    details: SampleDetails = {}
    for position, sample in enumerate(samples):
        found = {key: sample.metadata.pop(key) for key in DETAIL_KEYS if key in sample.metadata}
        if found:
            details[position] = found
    return details


def put_details(samples: Sequence[Any], parts: Iterable[Mapping[int, Mapping[str, Any]] | None]) -> None:
    """Put the ranks' :func:`take_details` answers into ``samples`` (the list they trained on);
    a value a sample already has (from an earlier rank, or this process's trainer) is kept."""
    for details in parts:
        for position, values in (details or {}).items():
            metadata = samples[position].metadata
            for key, value in values.items():
                metadata.setdefault(key, value)
