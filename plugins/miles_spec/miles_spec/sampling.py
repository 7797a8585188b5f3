"""Speculative sampling: accept draft tokens so that output tokens follow the policy exactly.

For each draft position ``j`` the target distribution ``p_j`` is what the
plain engine samples from (``softmax(logits / T)`` truncated by top-k/top-p/
min-p and renormalised, banned tokens removed; one-hot argmax when greedy).
Draft token ``d_j ~ q_j`` is accepted with probability ``min(1, p_j(d_j) /
q_j(d_j))``; at the first rejection the emitted token is drawn from
``normalize(max(0, p_j - q_j))``; when all ``k`` are accepted a bonus token is
drawn from ``p_{k+1}`` (Leviathan et al. 2023, Chen et al. 2023). Greedy: a
draft is accepted iff it equals the policy's argmax, and the correction is the
argmax. Returned logprobs are the policy's ``log_softmax(logits / T)`` at the
emitted tokens (``log_softmax(logits)`` when greedy), before truncation, as
:mod:`miles_host.rollout.sampler` returns them.

Tensor legend: B sequences, K draft tokens, J = K + 1 verified positions, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from miles_host.rollout.sampler import SamplingBatch, exponential_noise, truncation_mask
from miles_host.rollout.sampling_params import SamplingParams


class RowSettings(SamplingBatch):
    """Per-sequence sampling settings on device: the host sampler's, so speculative
    acceptance truncates exactly as plain sampling does."""

    @classmethod
    def build(cls, params: list[SamplingParams], generators, device) -> "RowSettings":
        batch = SamplingBatch.build(params, list(generators), [[] for _ in params], device)
        return cls(**{f.name: getattr(batch, f.name) for f in fields(SamplingBatch)})


def distributions(
    logits_BJV: torch.Tensor, rows: RowSettings, banned_BJV: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs_BJV, logprobs_BJV)``: the distribution sampled from, and the logprobs reported."""
    logits_BJV = logits_BJV.float()
    batch, positions, vocab = logits_BJV.shape
    greedy_B1 = rows.greedy_B[:, None]
    scaled_BJV = logits_BJV / torch.where(greedy_B1, 1.0, rows.temperature_B[:, None])[..., None]
    logprobs_BJV = torch.log_softmax(scaled_BJV, dim=-1)
    flat = logprobs_BJV.reshape(batch * positions, vocab)

    def repeat(values):
        return None if values is None else values.repeat_interleave(positions)

    keep = truncation_mask(flat, repeat(rows.top_k_B), repeat(rows.top_p_B), repeat(rows.min_p_B))
    sampled_BJV = logprobs_BJV if keep is None else logprobs_BJV.masked_fill(~keep.view_as(logprobs_BJV), float("-inf"))
    choice_BJV = logits_BJV
    if banned_BJV is not None:
        sampled_BJV = sampled_BJV.masked_fill(banned_BJV, float("-inf"))
        choice_BJV = logits_BJV.masked_fill(banned_BJV, float("-inf"))
    probs_BJV = torch.softmax(sampled_BJV, dim=-1)
    if bool(rows.greedy_B.any()):
        one_hot_BJV = torch.zeros_like(probs_BJV).scatter_(-1, choice_BJV.argmax(-1, keepdim=True), 1.0)
        probs_BJV = torch.where(greedy_B1[..., None], one_hot_BJV, probs_BJV)
    return probs_BJV, logprobs_BJV


def sample_from(probs_BV: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row from ``probs_BV`` (exponential race; seeded rows use their generator)."""
    noise_BV = exponential_noise(tuple(probs_BV.shape), generators, probs_BV.device)
    return (probs_BV.log() - noise_BV.log()).argmax(dim=-1)


def uniform(shape: tuple[int, int], generators: list[torch.Generator | None], device) -> torch.Tensor:
    """``U[0, 1)`` ``[B, K]``; seeded rows draw from their generator."""
    out = torch.rand(shape, device=device)
    for row, generator in enumerate(generators):
        if generator is not None:
            out[row] = torch.rand(shape[1], device=device, generator=generator)
    return out


@dataclass
class Verdict:
    """Per sequence: the emitted tokens (accepted drafts + one) and their logprobs."""

    num_accepted_B: torch.Tensor     # [B] leading accepted drafts
    tokens_BJ: torch.Tensor          # [B, K + 1]: drafts, with the correction/bonus at num_accepted
    logprobs_BJ: torch.Tensor        # [B, K + 1] policy logprobs of tokens_BJ


def accept(
    target_probs_BJV: torch.Tensor,
    target_logprobs_BJV: torch.Tensor,
    draft_probs_BKV: torch.Tensor,
    draft_tokens_BK: torch.Tensor,
    generators: list[torch.Generator | None],
) -> Verdict:
    """Speculative sampling of one verify step (see the module docstring)."""
    batch, num_drafts = draft_tokens_BK.shape
    index_BK1 = draft_tokens_BK[..., None]
    p_BK = target_probs_BJV[:, :num_drafts].gather(-1, index_BK1).squeeze(-1)
    q_BK = draft_probs_BKV.gather(-1, index_BK1).squeeze(-1)
    u_BK = uniform((batch, num_drafts), generators, p_BK.device)
    accepted_BK = u_BK * q_BK < p_BK
    num_accepted_B = accepted_BK.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(batch, device=p_BK.device)
    # The distribution of the emitted extra token: residual at the first rejection, else the bonus.
    target_BV = target_probs_BJV[rows, num_accepted_B]
    padded_BJV = torch.cat([draft_probs_BKV, torch.zeros_like(draft_probs_BKV[:, :1])], dim=1)
    residual_BV = (target_BV - padded_BJV[rows, num_accepted_B]).clamp_min(0)
    empty_B1 = residual_BV.sum(-1, keepdim=True) <= 0
    residual_BV = torch.where(empty_B1, target_BV, residual_BV)
    extra_B = sample_from(residual_BV / residual_BV.sum(-1, keepdim=True), generators)
    tokens_BJ = torch.cat([draft_tokens_BK, torch.zeros_like(draft_tokens_BK[:, :1])], dim=1)
    tokens_BJ[rows, num_accepted_B] = extra_B
    logprobs_BJ = target_logprobs_BJV.gather(-1, tokens_BJ[..., None]).squeeze(-1)
    return Verdict(num_accepted_B, tokens_BJ, logprobs_BJ)
