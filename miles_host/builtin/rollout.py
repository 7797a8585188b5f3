"""Built-in plugin: the embedded rollout backend and plain decoding."""

from __future__ import annotations

from miles_host.records import DecodingStrategy, RolloutBackend


def _embedded(config, manager):
    from miles_host.rollout_backend import EmbeddedRolloutBackend

    return EmbeddedRolloutBackend(config, manager)


def check_engine_sequences(config, registries=None):
    """``validate`` of the engine backends: the engine takes a prompt's samples as one request of
    ``n`` sequences, refused above ``--rollout-max-num-seqs`` (so every sample would fail)."""
    from miles_host.rollout.config import EngineConfig
    from miles_host.sglang_embedded import check_engine_sglang_args, engine_max_num_seqs

    check_engine_sglang_args(config)  # one GPU per engine; the --sglang-* flags it ignores warned about
    limit = engine_max_num_seqs(config, EngineConfig.__dataclass_fields__["max_num_seqs"].default)
    if config.n_samples_per_prompt > limit:
        raise ValueError(
            f"--n-samples-per-prompt {config.n_samples_per_prompt} exceeds the {limit} sequences the rollout engine "
            f"runs at once (--rollout-max-num-seqs); lower it, or give --rollout-max-num-seqs "
            f"{config.n_samples_per_prompt} or more"
        )


def miles_register_rollout_backends():
    """The in-process engine over the shared model code."""
    return [RolloutBackend("embedded", "in-process engine (continuous batching, paged KV cache)", factory=_embedded,
                           distributed_variant="process", validate=check_engine_sequences)]


def miles_register_decoding_strategies():
    """One token per step from the policy itself."""
    return [DecodingStrategy("plain", "one policy forward per generated token", factory=None)]
