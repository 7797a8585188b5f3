"""Sampling parameters with SGLang's names and meanings.

A request's ``sampling_params`` dict is validated here, before the request
enters the engine, so a bad value raises a ``ValueError`` that names the field
and the request never touches the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

_KNOWN = None  # filled below: the field names SamplingParams accepts


@dataclass
class SamplingParams:
    """How one request is decoded (SGLang spellings).

    ``temperature == 0`` means greedy. ``top_k <= 0`` (SGLang uses -1) and
    ``top_p == 1`` and ``min_p == 0`` disable those truncations. ``stop`` strings
    are matched on decoded text and need the engine to have a tokenizer.
    ``sampling_seed`` gives the request its own ``torch.Generator`` so its samples
    do not depend on what else runs. ``n`` samples share the prompt's KV blocks.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = None
    n: int = 1
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        _check(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 0,
               f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        _check(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
               f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        _check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1 or self.top_k == 0),
               f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        _check(isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1,
               f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(isinstance(self.min_new_tokens, int) and 0 <= self.min_new_tokens,
               f"min_new_tokens must be an integer >= 0, got {self.min_new_tokens!r}")
        _check(self.sampling_seed is None or isinstance(self.sampling_seed, int),
               f"sampling_seed must be an integer or None, got {self.sampling_seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop must be a list of non-empty strings, got {self.stop!r}")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.min_p = float(self.min_p)
        if self.top_k == 0:
            self.top_k = -1

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token."""
        return self.temperature == 0.0

    @classmethod
    def from_any(cls, params: "SamplingParams | dict[str, Any] | None") -> "SamplingParams":
        """Build from a dict with SGLang keys; unknown keys are a ``ValueError``."""
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        if not isinstance(params, dict):
            raise ValueError(f"sampling_params must be a dict or SamplingParams, got {type(params).__name__}")
        unknown = sorted(set(params) - _KNOWN)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s) {unknown}; supported: {sorted(_KNOWN)}"
            )
        return cls(**{k: v for k, v in params.items() if v is not None or k == "sampling_seed"})


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"invalid sampling_params: {message}")


_KNOWN = {f.name for f in fields(SamplingParams)}
