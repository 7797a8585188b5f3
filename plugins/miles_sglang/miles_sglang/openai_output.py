"""Engine outputs -> OpenAI choice text and logprobs (final and streamed).

The engine hands back ``output_ids`` with the token that stopped generation
(EOS or a stop token) and ``meta_info.finish_reason`` naming what matched. OpenAI
text leaves the stop out: the matched stop token is dropped and the text is cut
before a matched stop string (``no_stop_trim`` keeps both, as in SGLang); special
tokens are skipped when decoding unless ``skip_special_tokens`` is false.

While streaming, a partial text holds back a trailing incomplete UTF-8 character
(decoded as U+FFFD) and any tail that could be the start of a stop string, so
nothing sent has to be taken back.

Logprob entries are SGLang's ``[logprob, token_id, text]`` triples
(``meta_info.output_token_logprobs``; top alternatives per token in
``meta_info.output_top_logprobs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles_sglang.openai_protocol import ChatTokenLogprob, CompletionLogprobs, TopLogprob

_REPLACEMENT = "\ufffd"

#: SGLang finish_reason type -> OpenAI finish_reason (anything else passes through)
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass
class TextRules:
    """How one request's samples turn into text."""

    tokenizer: Any
    stops: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    def kept_ids(self, output_ids: list[int], finish: dict | None) -> list[int]:
        """The ids whose text is sent: without a matched stop token (EOS / stop_token_ids)."""
        matched = (finish or {}).get("matched")
        if (not self.no_stop_trim and finish and finish.get("type") == "stop" and isinstance(matched, int)
                and output_ids and output_ids[-1] == matched):
            return output_ids[:-1]
        return output_ids

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None or not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def final_text(self, output_ids: list[int], finish: dict | None) -> str:
        """The text of a finished sample."""
        text = self.decode(self.kept_ids(output_ids, finish))
        matched = (finish or {}).get("matched")
        if not self.no_stop_trim and isinstance(matched, str) and matched:
            cut = text.find(matched)
            if cut >= 0:
                text = text[:cut]
        return text

    def partial_text(self, output_ids: list[int]) -> str:
        """The text of an unfinished sample that is safe to send now."""
        text = self.decode(output_ids).rstrip(_REPLACEMENT)
        for stop in self.stops:
            cut = text.find(stop)
            if cut >= 0:
                text = text[:cut]
        hold = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    hold = max(hold, size)
                    break
        return text[:len(text) - hold]


def finish_reason(finish: dict | None) -> str | None:
    """OpenAI's ``finish_reason`` for SGLang's ``{"type": ...}``."""
    if not finish:
        return None
    kind = finish.get("type")
    return FINISH_REASONS.get(kind, kind)


def matched_stop(finish: dict | None) -> int | str | None:
    """SGLang's ``matched_stop``: the token id or string that stopped the sample."""
    return (finish or {}).get("matched")


# ----------------------------------------------------------------------------
# logprobs
# ----------------------------------------------------------------------------


def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def _entries(meta: dict, start: int, end: int) -> tuple[list, list | None]:
    chosen = (meta.get("output_token_logprobs") or [])[start:end]
    top = meta.get("output_top_logprobs")
    return chosen, (top[start:end] if top is not None else None)


def _top_pairs(entries: Any, limit: int) -> list[tuple[float, int]]:
    pairs = [(float(e[0]), int(e[1])) for e in (entries or []) if e and e[0] is not None]
    return pairs[:limit]


def chat_logprobs(tokenizer: Any, meta: dict, start: int, end: int, top_n: int) -> list[ChatTokenLogprob]:
    """Chat's ``logprobs.content`` for output tokens ``start:end``."""
    chosen, top = _entries(meta, start, end)
    out = []
    for i, (logprob, token_id, *_rest) in enumerate(chosen):
        token = _token_text(tokenizer, int(token_id))
        alternatives = []
        if top is not None and top_n:
            for alt_logprob, alt_id in _top_pairs(top[i], top_n):
                alt = _token_text(tokenizer, alt_id)
                alternatives.append(TopLogprob(token=alt, logprob=alt_logprob, bytes=list(alt.encode())))
        out.append(ChatTokenLogprob(token=token, logprob=float(logprob), bytes=list(token.encode()),
                                    top_logprobs=alternatives))
    return out


def completion_logprobs(tokenizer: Any, meta: dict, start: int, end: int, top_n: int, offset: int,
                        prefix: list | None = None) -> CompletionLogprobs:
    """The completions ``logprobs`` object for output tokens ``start:end``.

    ``prefix``: ``[logprob | None, token_id, ...]`` entries put first (the prompt's, for ``echo``);
    ``offset``: the character offset of the first token in the choice's text.
    """
    chosen, top = _entries(meta, start, end)
    result = CompletionLogprobs()
    rows = [(e, None) for e in (prefix or [])] + [(e, top[i] if top is not None else None) for i, e in enumerate(chosen)]
    for entry, alternatives in rows:
        logprob, token_id = entry[0], int(entry[1])
        token = _token_text(tokenizer, token_id)
        result.tokens.append(token)
        result.token_logprobs.append(None if logprob is None else float(logprob))
        result.top_logprobs.append(
            None if alternatives is None and top_n else
            {_token_text(tokenizer, i): lp for lp, i in _top_pairs(alternatives, top_n)}
        )
        result.text_offset.append(offset)
        offset += len(token)
    return result
