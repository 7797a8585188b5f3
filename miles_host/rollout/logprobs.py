"""Log-probs beyond the sampled tokens': SGLang's ``top_logprobs_num``, ``token_ids_logprob``
and ``logprob_start_len`` (``GenerateReqInput`` in ``managers/io_struct.py``).

Output positions read the distribution the token was sampled from (the sampler's
``log_softmax`` of the processed logits over temperature, or of the logits when greedy,
before top-k / top-p / min-p), as SGLang's ``Sampler`` does. Input (prompt) positions
read ``log_softmax`` of the raw logits, as SGLang's ``LogitsProcessor`` does: position
``i`` of the prompt gets the logprob of token ``i`` given the tokens before it; the
first position reported has none (``None``), as in SGLang, even when it is not the
prompt's first token.

Results are plain host lists: ``(token id, logprob)`` pairs, the top ones in
descending order, the requested ids in the order asked.

Tensor legend: B = rows, V = vocabulary, T = prompt positions, K = top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

#: prompt rows whose logits are materialised at once for input logprobs (128 x 152k float32: 78 MB)
INPUT_CHUNK = 128

Pairs = list[tuple[int, float]]


@dataclass(frozen=True)
class LogprobOptions:
    """What a request asks of logprobs besides each sampled token's (SGLang's defaults)."""

    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] | None = None
    logprob_start_len: int = -1

    @classmethod
    def build(
        cls, top_logprobs_num: int | None = 0, token_ids_logprob: list[int] | None = None,
        logprob_start_len: int | None = -1,
    ) -> "LogprobOptions":
        """Validated options (``None`` = the default); a bad value is a ``ValueError`` naming it."""
        top_logprobs_num = 0 if top_logprobs_num is None else top_logprobs_num
        logprob_start_len = -1 if logprob_start_len is None else logprob_start_len
        if not _is_int(top_logprobs_num) or top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be an integer >= 0, got {top_logprobs_num!r}")
        if not _is_int(logprob_start_len) or logprob_start_len < -1:
            raise ValueError(f"logprob_start_len must be -1 (no input logprobs) or >= 0, got {logprob_start_len!r}")
        if token_ids_logprob is not None:
            if _is_int(token_ids_logprob):
                token_ids_logprob = [token_ids_logprob]
            if not isinstance(token_ids_logprob, (list, tuple)) or not all(_is_int(t) for t in token_ids_logprob):
                raise ValueError(f"token_ids_logprob must be a list of token ids, got {token_ids_logprob!r}")
            token_ids_logprob = tuple(token_ids_logprob) or None  # SGLang: [] means none
        return cls(top_logprobs_num, token_ids_logprob, logprob_start_len)

    def check(self, prompt_len: int, vocab_size: int) -> None:
        """``ValueError`` for options the prompt or vocabulary cannot meet."""
        if self.logprob_start_len > prompt_len:
            raise ValueError(
                f"logprob_start_len={self.logprob_start_len} is larger than the prompt ({prompt_len} tokens): "
                "use a smaller logprob_start_len"
            )
        bad = [t for t in self.token_ids_logprob or () if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token_ids_logprob ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        if self.top_logprobs_num > vocab_size:
            raise ValueError(f"top_logprobs_num={self.top_logprobs_num} exceeds the vocabulary size {vocab_size}")

    @property
    def wants_output_extras(self) -> bool:
        """Whether each generated position needs more than the sampled token's logprob."""
        return self.top_logprobs_num > 0 or self.token_ids_logprob is not None

    @property
    def wants_input(self) -> bool:
        """Whether the prompt's logprobs are asked for."""
        return self.logprob_start_len >= 0

    @property
    def any(self) -> bool:
        return self.wants_output_extras or self.wants_input


@dataclass
class InputLogprobs:
    """The prompt's logprobs from ``logprob_start_len`` on (SGLang's ``input_*`` fields):
    one entry per token of ``token_ids``, the first ``None``."""

    token_ids: list[int]
    token_logprobs: list[float | None]
    top_logprobs: list[Pairs | None] | None = None       # when top_logprobs_num > 0
    token_ids_logprobs: list[Pairs | None] | None = None  # when token_ids_logprob is given


@dataclass
class PositionExtras:
    """One generated position's top logprobs and requested-id logprobs (None: not asked)."""

    top: Pairs | None = None
    token_ids: Pairs | None = None


def position_extras(logprobs_BV: torch.Tensor, options: list[LogprobOptions | None]) -> list[PositionExtras | None]:
    """Each row's :class:`PositionExtras` from its distribution ``logprobs_BV`` (one copy to the host)."""
    wanted = [row for row, o in enumerate(options) if o is not None and o.wants_output_extras]
    result: list[PositionExtras | None] = [None] * len(options)
    if not wanted:
        return result
    tops = _top_pairs(logprobs_BV, wanted, [options[r].top_logprobs_num for r in wanted])
    for row, top in zip(wanted, tops):
        ids = options[row].token_ids_logprob
        result[row] = PositionExtras(top=top, token_ids=_id_pairs(logprobs_BV[row], ids) if ids else None)
    return result


def _top_pairs(logprobs_BV: torch.Tensor, rows: list[int], nums: list[int]) -> list[Pairs | None]:
    k = max(nums)
    if k == 0:
        return [None] * len(rows)
    index = torch.tensor(rows, device=logprobs_BV.device)
    values_RK, ids_RK = logprobs_BV.index_select(0, index).topk(k, dim=-1)
    values, ids = values_RK.tolist(), ids_RK.tolist()
    return [list(zip(ids[i][:n], values[i][:n])) if n > 0 else None for i, n in enumerate(nums)]


def _id_pairs(logprobs_V: torch.Tensor, token_ids: tuple[int, ...]) -> Pairs:
    values = logprobs_V[torch.tensor(token_ids, device=logprobs_V.device)].tolist()
    return list(zip(token_ids, values))


def input_logprobs(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    hidden_TH: torch.Tensor,
    prompt: list[int],
    options: LogprobOptions,
) -> InputLogprobs:
    """:class:`InputLogprobs` of ``prompt`` from the hidden states of all its positions
    (``hidden_TH[i]`` predicts token ``i + 1``); logits ``INPUT_CHUNK`` rows at a time."""
    start = options.logprob_start_len
    token_ids = prompt[start:]
    result = InputLogprobs(
        token_ids=token_ids, token_logprobs=[],
        top_logprobs=[] if options.top_logprobs_num > 0 else None,
        token_ids_logprobs=[] if options.token_ids_logprob is not None else None,
    )
    if not token_ids:
        return result
    # positions start .. len-2 predict tokens start+1 .. len-1; the first reported token has none
    result.token_logprobs.append(None)
    for extra in (result.top_logprobs, result.token_ids_logprobs):
        if extra is not None:
            extra.append(None)
    targets = torch.tensor(prompt, device=hidden_TH.device)
    for first in range(start, len(prompt) - 1, INPUT_CHUNK):
        last = min(first + INPUT_CHUNK, len(prompt) - 1)
        logprobs_CV = torch.log_softmax(logits_fn(hidden_TH[first:last]).float(), dim=-1)
        rows = torch.arange(last - first, device=logprobs_CV.device)
        result.token_logprobs.extend(logprobs_CV[rows, targets[first + 1:last + 1]].tolist())
        chunk_options = [options] * (last - first)
        for extras in position_extras(logprobs_CV, chunk_options):
            if result.top_logprobs is not None:
                result.top_logprobs.append(extras.top)
            if result.token_ids_logprobs is not None:
                result.token_ids_logprobs.append(extras.token_ids)
    return result


@dataclass
class OutputExtras:
    """A sequence's per-position extras so far (lists grow with its output)."""

    top_logprobs: list[Pairs | None] = field(default_factory=list)
    token_ids_logprobs: list[Pairs | None] = field(default_factory=list)

    def append(self, extras: PositionExtras | None) -> None:
        self.top_logprobs.append(extras.top if extras is not None else None)
        self.token_ids_logprobs.append(extras.token_ids if extras is not None else None)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
