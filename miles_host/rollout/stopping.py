"""When a sequence stops: stop tokens, EOS, stop strings, max_new_tokens, the context length.

SGLang's rules: stop tokens, EOS (unless ``ignore_eos``) and stop strings count only
once ``min_new_tokens`` tokens were generated; ``finish_reason`` is
``{"type": "stop", "matched": token or string}`` or ``{"type": "length", "length": n}``.
"""

from __future__ import annotations

from typing import Any

from miles_host.rollout.sequence import Sequence


def finish_reason(
    seq: Sequence, eos_token_ids: tuple[int, ...], max_model_len: int, tokenizer: Any, position: int | None = None
) -> dict[str, Any] | None:
    """Why ``seq`` stops after its token at ``position`` (default: its last), or None."""
    params = seq.params
    position = len(seq.token_ids) - 1 if position is None else position
    token = seq.token_ids[position]
    num_output = position + 1 - seq.num_prompt_tokens
    if num_output >= params.min_new_tokens:
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
            return {"type": "stop", "matched": token}
        if params.stop:
            matched = matched_stop_string(seq, tokenizer, position + 1)
            if matched is not None:
                return {"type": "stop", "matched": matched}
    if num_output >= params.max_new_tokens:
        return {"type": "length", "length": params.max_new_tokens}
    if position + 1 >= max_model_len:
        return {"type": "length", "length": num_output}
    return None


def matched_stop_string(seq: Sequence, tokenizer: Any, end: int) -> str | None:
    """The stop string in the decoded output tail ending before token ``end``, if any."""
    longest = max(len(s) for s in seq.params.stop)
    # Only the tail can contain a new match; a token is at least one character.
    tail = tokenizer.decode(seq.token_ids[max(seq.num_prompt_tokens, end - longest - 1):end])
    for stop in seq.params.stop:
        if stop in tail:
            return stop
    return None
