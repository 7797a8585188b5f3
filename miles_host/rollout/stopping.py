"""When a sequence stops: stop tokens, EOS, stop strings, stop regexes, a complete grammar,
max_new_tokens, the context length.

SGLang's rules: stop tokens, EOS (unless ``ignore_eos``), stop strings and ``stop_regex``
patterns (searched in the decoded output) count only once ``min_new_tokens`` tokens were
generated; ``finish_reason`` is ``{"type": "stop", "matched": token, string or pattern}``
or ``{"type": "length", "length": n}``.
"""

from __future__ import annotations

import re
from typing import Any

from miles_host.rollout.sequence import Sequence


def finish_reason(
    seq: Sequence, eos_token_ids: tuple[int, ...], max_model_len: int, tokenizer: Any, position: int | None = None
) -> dict[str, Any] | None:
    """Why ``seq`` stops after its token at ``position`` (default: its last), or None."""
    params = seq.params
    if seq.grammar is not None and seq.grammar.rejected is not None:
        return {"type": "abort", "message": f"the grammar allows no token the request may sample (it rejected "
                                            f"token {seq.grammar.rejected}): check min_new_tokens and the grammar"}
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
        if params.stop_regex:
            matched = matched_stop_regex(seq, tokenizer, position + 1)
            if matched is not None:
                return {"type": "stop", "matched": matched}
    if num_output >= params.max_new_tokens:
        return {"type": "length", "length": params.max_new_tokens}
    if position + 1 >= max_model_len:
        return {"type": "length", "length": num_output}
    if seq.grammar is not None and seq.grammar.is_terminated:
        return {"type": "stop", "matched": token}
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


def matched_stop_regex(seq: Sequence, tokenizer: Any, end: int) -> str | None:
    """The first ``stop_regex`` pattern found in the decoded output before token ``end``, if any."""
    text = tokenizer.decode(seq.token_ids[seq.num_prompt_tokens:end])
    for pattern in seq.params.stop_regex:
        if re.search(pattern, text):
            return pattern
    return None
