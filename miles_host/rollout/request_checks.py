"""Checks of a request's sampling and logprob features against the engine that would run it.

Each is a ``ValueError`` that names the key and says what to do. What a feature needs:

- ``stop`` / ``stop_regex`` / a grammar: a tokenizer (they work on text);
- ``logit_bias`` / ``token_ids_logprob``: token ids inside the vocabulary;
- penalties, ``logit_bias`` or a grammar change the logits the token is sampled from, so
  not with ``batch_invariant`` (true on-policy: the trainer recomputes the returned
  logprobs from the plain logits) nor with a decoding strategy (speculative decoding
  samples from the plain distribution); top / requested-id logprobs per position are not
  produced by a decoding strategy either.
"""

from __future__ import annotations

from typing import Any

from miles_host.rollout.logprobs import LogprobOptions
from miles_host.rollout.sampling_params import SamplingParams


def _logit_changes(params: SamplingParams) -> list[str]:
    """The keys of ``params`` that change the logits before sampling."""
    changes = [name for name, off in (("frequency_penalty", 0.0), ("presence_penalty", 0.0),
                                      ("repetition_penalty", 1.0)) if getattr(params, name) != off]
    if params.logit_bias:
        changes.append("logit_bias")
    if params.grammar is not None:
        changes.append(params.grammar[0])
    return changes


def check_features(
    params: SamplingParams,
    options: LogprobOptions,
    prompt_len: int,
    *,
    vocab_size: int,
    has_tokenizer: bool,
    batch_invariant: bool,
    strategy: Any,
) -> None:
    """``ValueError`` if the engine cannot run ``params`` / ``options`` as asked."""
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer: pass tokenizer= to the engine or use stop_token_ids")
    if params.stop_regex and not has_tokenizer:
        raise ValueError("stop_regex needs a tokenizer (it is matched on decoded text): pass tokenizer= to the engine")
    bad = [t for t in params.logit_bias or {} if t >= vocab_size]
    if bad:
        raise ValueError(f"invalid sampling_params: logit_bias keys {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    options.check(prompt_len, vocab_size)
    changes = _logit_changes(params)
    if changes and batch_invariant:
        raise ValueError(
            f"{changes} change the sampled distribution, which batch_invariant (true on-policy) rollouts "
            "must keep equal to the trainer's: drop them or turn batch_invariant off"
        )
    if strategy is not None:
        if changes:
            raise ValueError(
                f"{changes} are not supported with the engine's decoding strategy ({type(strategy).__name__}): "
                "drop them or run the engine without speculative decoding"
            )
        if options.wants_output_extras:
            raise ValueError(
                f"top_logprobs_num / token_ids_logprob are not produced by the engine's decoding strategy "
                f"({type(strategy).__name__}): drop them or run the engine without speculative decoding"
            )
