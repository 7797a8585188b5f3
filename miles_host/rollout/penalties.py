"""Logit changes before temperature: SGLang's penalties, grammar mask and ``logit_bias``.

Per row, over the tokens the sequence generated so far (never its prompt), in
SGLang's order (``sampling_batch_info.apply_logits_bias``, overlap mode):

1. additive penalties: ``logits -= frequency_penalty * count + presence_penalty * (count > 0)``;
2. repetition penalty (multiplicative) on every token that appeared:
   ``logits * r`` where the logit is negative, ``logits / r`` elsewhere;
3. the grammar mask (:mod:`.grammar`): disallowed tokens get ``-inf``;
4. ``logit_bias``: ``logits[token] += bias``.

Temperature, top-k / top-p / min-p and the returned logprobs all follow on the
changed logits, as in SGLang. A step with no such request builds nothing, so the
logits are untouched (bit-exact with a request that never asked); a row without
them in a mixed batch gets ``+ 0`` and ``* 1``, which are exact too.

Tensor legend: B = rows, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_host.devices import host_to_device
from miles_host.rollout.sampling_params import SamplingParams


@dataclass
class LogitsProcessing:
    """One step's per-row logit changes (each part None when no row needs it)."""

    additive_BV: torch.Tensor | None = None
    repetition_BV: torch.Tensor | None = None   # the factor where the token appeared, 1 elsewhere
    allowed_BV: torch.Tensor | None = None      # bool: what the rows' grammars allow
    bias_BV: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        outputs: list[list[int]],
        vocab_size: int,
        device: torch.device,
        allowed_BV: torch.Tensor | None = None,
    ) -> "LogitsProcessing | None":
        """The changes for rows with ``params`` that generated ``outputs`` so far; None if none."""
        penalised = [row for row, p in enumerate(params) if p.has_penalties and (outputs[row] or p.logit_bias)]
        if not penalised and allowed_BV is None:
            return None
        batch = len(params)
        processing = cls(allowed_BV=allowed_BV)

        def column(values: list[float]) -> torch.Tensor:
            return host_to_device(torch.tensor(values, dtype=torch.float32), device)[:, None]

        # [B, V] tensors are built on the device from small index lists (no [B, V] copy)
        counts_BV = _counts(outputs, penalised, batch, vocab_size, device)
        if any(params[r].frequency_penalty or params[r].presence_penalty for r in penalised):
            frequency_B1 = column([p.frequency_penalty for p in params])
            presence_B1 = column([p.presence_penalty for p in params])
            processing.additive_BV = -(frequency_B1 * counts_BV) - presence_B1 * (counts_BV > 0)
        if any(params[r].repetition_penalty != 1.0 for r in penalised):
            factor_B1 = column([p.repetition_penalty for p in params])
            processing.repetition_BV = torch.where(counts_BV > 0, factor_B1, torch.ones((), device=device))
        if any(params[r].logit_bias for r in penalised):
            entries = [(row, token, amount) for row in penalised for token, amount in (params[row].logit_bias or {}).items()]
            rows, tokens, amounts = (list(values) for values in zip(*entries))
            processing.bias_BV = torch.zeros(batch, vocab_size, device=device).index_put_(
                (_index(rows, device), _index(tokens, device)), column(amounts)[:, 0]
            )
        return processing

    def apply(self, logits_BV: torch.Tensor) -> torch.Tensor:
        """The changed float32 logits (a new tensor; ``logits_BV`` is not modified)."""
        logits_BV = logits_BV.float()
        if self.additive_BV is not None:
            logits_BV = logits_BV + self.additive_BV
        if self.repetition_BV is not None:
            logits_BV = torch.where(logits_BV < 0, logits_BV * self.repetition_BV, logits_BV / self.repetition_BV)
        if self.allowed_BV is not None:
            logits_BV = logits_BV.masked_fill(~self.allowed_BV, float("-inf"))
        if self.bias_BV is not None:
            logits_BV = logits_BV + self.bias_BV
        return logits_BV


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return host_to_device(torch.tensor(values, dtype=torch.long), device)


def _counts(outputs: list[list[int]], rows: list[int], batch: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[B, V]`` float32 on ``device``: how often each row of ``rows`` generated each token
    (0 for other rows)."""
    counts_BV = torch.zeros(batch, vocab_size, device=device)
    row_index = [row for row in rows for _ in outputs[row]]
    if row_index:
        tokens = [token for row in rows for token in outputs[row]]
        counts_BV.index_put_(
            (_index(row_index, device), _index(tokens, device)), torch.ones(len(tokens), device=device),
            accumulate=True,
        )
    return counts_BV
