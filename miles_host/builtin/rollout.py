"""Built-in plugin: the embedded rollout backend and plain decoding."""

from __future__ import annotations

from miles_host.records import DecodingStrategy, RolloutBackend


def _embedded(config, manager):
    from miles_host.rollout_backend import EmbeddedRolloutBackend

    return EmbeddedRolloutBackend(config, manager)


def miles_register_rollout_backends():
    """The in-process engine over the shared model code."""
    return [RolloutBackend("embedded", "in-process engine (continuous batching, paged KV cache)", factory=_embedded,
                           distributed_variant="process")]


def miles_register_decoding_strategies():
    """One token per step from the policy itself."""
    return [DecodingStrategy("plain", "one policy forward per generated token", factory=None)]
