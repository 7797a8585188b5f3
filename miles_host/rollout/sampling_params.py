"""Sampling parameters with SGLang's names and meanings.

A request's ``sampling_params`` dict is validated here, before the request
enters the engine, so a bad value raises a ``ValueError`` that names the field
and the request never touches the batch. Every key of SGLang's own
``SamplingParams`` (``python/sglang/srt/sampling/sampling_params.py``) is a field
here; ``null`` means the default, as in SGLang. A key the engine cannot honour
(``beam_width`` above 1, ``watermark``) is a ``ValueError`` that says so.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any

#: temperatures below this are greedy (SGLang's ``_SAMPLING_EPS``)
GREEDY_BELOW = 1e-6

#: the grammar keys of constrained decoding, in the order SGLang picks the first one set
GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")


@dataclass
class SamplingParams:
    """How one request is decoded (SGLang spellings).

    ``temperature == 0`` (SGLang: below ``1e-6``) means greedy. ``top_k <= 0`` (SGLang uses -1) and
    ``top_p == 1`` and ``min_p == 0`` disable those truncations. ``stop`` strings
    and ``stop_regex`` patterns are matched on decoded text and need the engine to
    have a tokenizer. ``sampling_seed`` gives the request its own random stream so
    its samples do not depend on what else runs. ``n`` samples share the prompt's
    KV blocks.

    ``frequency_penalty`` / ``presence_penalty`` / ``repetition_penalty`` and
    ``logit_bias`` change the logits before temperature (:mod:`.penalties`);
    ``json_schema`` / ``regex`` / ``ebnf`` / ``structural_tag`` constrain them
    with a grammar (:mod:`.grammar`). ``skip_special_tokens``,
    ``spaces_between_special_tokens`` and ``no_stop_trim`` shape the returned
    ``text`` only. ``custom_params`` (read by SGLang's custom logit processors,
    which this engine does not run) and ``stream_interval`` (a server's streaming
    cadence) are carried along unchanged.
    """

    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    beam_width: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None
    logit_bias: dict[int, float] | None = None
    sampling_seed: int | None = None
    custom_params: dict[str, Any] | None = None
    watermark: Any = None

    def __post_init__(self) -> None:
        self.stop = _string_list(self.stop, "stop")
        self.stop_regex = _string_list(self.stop_regex, "stop_regex")
        _check(isinstance(self.stop_token_ids, (list, tuple, set)),
               f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = [t for t in self.stop_token_ids if t is not None]
        _check(all(_is_int(t) for t in self.stop_token_ids),
               f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        for name, ok, requirement in _RULES:
            _check(ok(getattr(self, name)), f"{name} {requirement}, got {getattr(self, name)!r}")
        _check(self.min_new_tokens <= self.max_new_tokens,
               f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens ({self.max_new_tokens})")
        for pattern in self.stop_regex:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(f"invalid sampling_params: stop_regex {pattern!r} is not a valid regular expression: {error}") from None
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            setattr(self, name, float(getattr(self, name)))
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0  # SGLang samples these greedily too
        if self.top_k == 0:
            self.top_k = -1
        self.logit_bias = _logit_bias(self.logit_bias)
        self._check_grammar()
        self._check_unsupported()

    def _check_grammar(self) -> None:
        for key in GRAMMAR_KEYS:
            value = getattr(self, key)
            if value in ("", {}):
                setattr(self, key, None)  # SGLang: an empty grammar means "unset"
            elif isinstance(value, dict) and key in ("json_schema", "structural_tag"):
                setattr(self, key, json.dumps(value))
            elif value is not None and not isinstance(value, str):
                raise ValueError(f"invalid sampling_params: {key} must be a string, got {type(value).__name__}")
        set_keys = [key for key in GRAMMAR_KEYS[:3] if getattr(self, key) is not None]
        _check(len(set_keys) <= 1, f"only one of regex, json_schema or ebnf can be set, got {set_keys}")

    def _check_unsupported(self) -> None:
        if self.beam_width is not None and self.beam_width != 1:
            raise ValueError(
                f"invalid sampling_params: beam_width={self.beam_width!r}: beam search is not supported by the "
                "embedded engine; drop beam_width (or set it to 1) and use n for several samples"
            )
        if self.watermark is not None:
            raise ValueError(
                "invalid sampling_params: watermark is not supported by the embedded engine; drop the key"
            )

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token."""
        return self.temperature == 0.0

    @property
    def grammar(self) -> tuple[str, str] | None:
        """``(key, specification)`` of the request's constrained decoding, or None."""
        for key in GRAMMAR_KEYS:
            value = getattr(self, key)
            if value is not None:
                return key, value
        return None

    @property
    def has_penalties(self) -> bool:
        """Whether the logits change before temperature (penalties or ``logit_bias``)."""
        return bool(
            self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @classmethod
    def from_any(cls, params: "SamplingParams | dict[str, Any] | None") -> "SamplingParams":
        """Build from a dict with SGLang keys (``null`` = the default); unknown keys are a ``ValueError``."""
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        if not isinstance(params, dict):
            raise ValueError(f"sampling_params must be a dict or SamplingParams, got {type(params).__name__}")
        unknown = sorted(set(params) - KNOWN_KEYS)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s) {unknown}; supported: {sorted(KNOWN_KEYS)}"
            )
        return cls(**{k: v for k, v in params.items() if v is not None})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_flag(value: Any) -> bool:
    return isinstance(value, bool)


#: (field, check, what the check requires): SGLang's ``verify`` ranges
_RULES: tuple[tuple[str, Any, str], ...] = (
    ("max_new_tokens", lambda v: _is_int(v) and v >= 0, "must be an integer >= 0"),
    ("temperature", lambda v: _is_number(v) and v >= 0, "must be a finite number >= 0 (0 means greedy)"),
    ("top_p", lambda v: _is_number(v) and 0 < v <= 1, "must be in (0, 1]"),
    ("top_k", lambda v: _is_int(v) and (v >= -1), "must be -1 (off) or >= 1"),
    ("min_p", lambda v: _is_number(v) and 0 <= v <= 1, "must be in [0, 1]"),
    ("frequency_penalty", lambda v: _is_number(v) and -2 <= v <= 2, "must be in [-2, 2]"),
    ("presence_penalty", lambda v: _is_number(v) and -2 <= v <= 2, "must be in [-2, 2]"),
    ("repetition_penalty", lambda v: _is_number(v) and 0 < v <= 2, "must be in (0, 2] (1 = no penalty)"),
    ("min_new_tokens", lambda v: _is_int(v) and v >= 0, "must be an integer >= 0"),
    ("n", lambda v: _is_int(v) and v >= 1, "must be an integer >= 1"),
    ("beam_width", lambda v: v is None or _is_int(v), "must be an integer"),
    ("ignore_eos", _is_flag, "must be true or false"),
    ("skip_special_tokens", _is_flag, "must be true or false"),
    ("spaces_between_special_tokens", _is_flag, "must be true or false"),
    ("no_stop_trim", _is_flag, "must be true or false"),
    ("stream_interval", lambda v: v is None or (_is_int(v) and v >= 1), "must be an integer >= 1"),
    ("sampling_seed", lambda v: v is None or _is_int(v), "must be an integer"),
    ("custom_params", lambda v: v is None or isinstance(v, dict), "must be an object"),
)


def _string_list(value: Any, name: str) -> list[str]:
    values = [value] if isinstance(value, str) else list(value or [])
    _check(all(isinstance(s, str) and s for s in values), f"{name} must be a string or a list of non-empty strings, got {value!r}")
    return values


def _logit_bias(value: Any) -> dict[int, float] | None:
    """``{token id: bias}`` from SGLang's / OpenAI's ``{"id": bias}`` (string keys, as JSON has them)."""
    if not value:
        return None
    _check(isinstance(value, dict), f"logit_bias must be an object of token id -> bias, got {value!r}")
    bias: dict[int, float] = {}
    for key, amount in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"invalid sampling_params: logit_bias key {key!r} is not a token id") from None
        _check(_is_number(amount) or amount == float("-inf"),
               f"logit_bias[{key!r}] must be a number, got {amount!r}")
        _check(token >= 0, f"logit_bias key {key!r} must be a token id >= 0")
        bias[token] = float(amount)
    return bias


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"invalid sampling_params: {message}")


#: the field names (and ``sampling_params`` keys) :meth:`SamplingParams.from_any` accepts
KNOWN_KEYS = frozenset(f.name for f in fields(SamplingParams))
