"""The records a run uses, whose ``validate`` fields the validation stage runs."""

from __future__ import annotations

from typing import Any, Iterator

from miles_host.records import Record
from miles_host.validation.host_checks import decoding_strategy_name


def selected_records(config: Any, registries: Any) -> Iterator[Record]:
    """The records the config selects by name, then the enabled ones (corrections,
    loss terms, loggers)."""
    yield registries.precisions.get(config.precision)
    yield registries.rollout_backends.get(config.rollout_backend)
    yield registries.decoding_strategies.get(decoding_strategy_name(config))
    yield registries.train_backends.get(config.train_backend)
    yield registries.weight_sync_transports.get(config.weight_sync)
    yield registries.advantage_estimators.get(config.advantage_estimator)
    if config.rm_type is not None:
        yield registries.reward_functions.get(config.rm_type)
    for registry in (registries.corrections, registries.loss_terms, registries.loggers):
        for record in registry:
            if record.enabled(config):
                yield record
