"""Token sampling without host synchronisation.

The returned logprob of a token is ``log_softmax(logits / temperature)`` at that
token (``log_softmax(logits)`` when greedy), taken before top-k / top-p / min-p
truncation: exactly what the trainer recomputes from the same logits.
Sampling uses the exponential race (``argmax(log p - log E)``, ``E ~ Exp(1)``
per vocabulary entry), equivalent to drawing from the truncated, renormalised
distribution, with no ``.item()`` and no ``multinomial``. Noise is drawn in
vocabulary order from the request's own generator when it has a
``sampling_seed``, so its tokens do not depend on the rest of the batch.

Tensor legend: B = rows (sequences being sampled), V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_host.rollout.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step, already on the logits' device."""

    temperature_B: torch.Tensor
    greedy_B: torch.Tensor
    top_k_B: torch.Tensor | None          # None when no row truncates by top-k
    top_p_B: torch.Tensor | None
    min_p_B: torch.Tensor | None
    generators: list[torch.Generator | None]
    all_greedy: bool
    banned: list[list[int]]               # token ids a row may not sample (min_new_tokens)
    any_greedy: bool = True
    all_unit_temperature: bool = False    # every sampled row has temperature 1: no division

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        banned: list[list[int]],
        device: torch.device,
    ) -> "SamplingBatch":
        def to_device(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        return cls(
            temperature_B=to_device([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32),
            greedy_B=to_device([p.greedy for p in params], torch.bool),
            top_k_B=to_device(top_k, torch.long) if any(top_k) else None,
            top_p_B=to_device([p.top_p for p in params], torch.float32) if any(p.top_p < 1 for p in params) else None,
            min_p_B=to_device([p.min_p for p in params], torch.float32) if any(p.min_p > 0 for p in params) else None,
            generators=generators,
            all_greedy=all(p.greedy for p in params),
            banned=banned,
            any_greedy=any(p.greedy for p in params),
            all_unit_temperature=all(p.greedy or p.temperature == 1.0 for p in params),
        )


def truncation_mask(
    logprobs_BV: torch.Tensor,
    top_k_B: torch.Tensor | None,
    top_p_B: torch.Tensor | None,
    min_p_B: torch.Tensor | None,
) -> torch.Tensor | None:
    """Boolean ``[B, V]`` of tokens that survive top-k, top-p and min-p (SGLang's rules).

    top-p keeps the smallest set of most likely tokens whose probability mass
    (of the untruncated distribution) reaches ``top_p``; min-p drops tokens below
    ``min_p`` times the most likely token's probability. ``None`` means all survive.
    """
    if top_k_B is None and top_p_B is None and min_p_B is None:
        return None
    sorted_logprobs_BV, order_BV = logprobs_BV.sort(dim=-1, descending=True)
    vocab = logprobs_BV.shape[-1]
    keep_BV = torch.ones_like(sorted_logprobs_BV, dtype=torch.bool)
    rank_V = torch.arange(vocab, device=logprobs_BV.device)
    if top_k_B is not None:
        k_B = torch.where(top_k_B > 0, top_k_B, vocab)
        keep_BV &= rank_V[None, :] < k_B[:, None]
    sorted_probs_BV = sorted_logprobs_BV.exp()
    if top_p_B is not None:
        mass_before_BV = sorted_probs_BV.cumsum(dim=-1) - sorted_probs_BV
        keep_BV &= mass_before_BV <= top_p_B[:, None]
    if min_p_B is not None:
        keep_BV &= sorted_probs_BV >= (sorted_probs_BV[:, :1] * min_p_B[:, None])
    keep_BV[:, 0] = True
    return torch.empty_like(keep_BV).scatter_(1, order_BV, keep_BV)


def exponential_noise(
    shape: tuple[int, int], generators: list[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    """``Exp(1)`` noise ``[B, V]``; rows with a generator draw from it alone."""
    noise_BV = torch.empty(shape, dtype=torch.float32, device=device)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < shape[0]:
        noise_BV.exponential_()
    for i in seeded:
        noise_BV[i].exponential_(generator=generators[i])
    return noise_BV


def sample(logits_BV: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (token ids ``[B]``, their logprobs ``[B]``) for one step, on device."""
    logits_BV = logits_BV.float()
    choice_BV = logits_BV
    if any(batch.banned):
        choice_BV = logits_BV.clone()
        for row, token_ids in enumerate(batch.banned):
            if token_ids:
                choice_BV[row, token_ids] = float("-inf")
    if batch.all_greedy:
        logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
        tokens_B = choice_BV.argmax(dim=-1)
        return tokens_B, logprobs_BV.gather(1, tokens_B[:, None]).squeeze(1)
    scaled_BV = logits_BV if batch.all_unit_temperature else logits_BV / batch.temperature_B[:, None]
    logprobs_BV = torch.log_softmax(scaled_BV, dim=-1)
    keep_BV = truncation_mask(logprobs_BV, batch.top_k_B, batch.top_p_B, batch.min_p_B)
    noise_BV = exponential_noise(tuple(logits_BV.shape), batch.generators, logits_BV.device)
    race_BV = logprobs_BV - noise_BV.log()
    if keep_BV is not None:
        race_BV = race_BV.masked_fill(~keep_BV, float("-inf"))
    for row, token_ids in enumerate(batch.banned):
        if token_ids:
            race_BV[row, token_ids] = float("-inf")
    tokens_B = race_BV.argmax(dim=-1)
    if batch.any_greedy:
        tokens_B = torch.where(batch.greedy_B, choice_BV.argmax(dim=-1), tokens_B)
    return tokens_B, logprobs_BV.gather(1, tokens_B[:, None]).squeeze(1)
