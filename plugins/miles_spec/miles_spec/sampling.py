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

Randomness: every draw inverts a CDF at one ``U[0, 1)`` number and every
acceptance compares with one, ``2k + 1`` numbers per sequence and step, made on
the host (:func:`step_uniforms`) and handed to the device with the step's other
inputs. A request with a ``sampling_seed`` gets them from the host sampler's
counter-based hash of (seed, sample, stream, position), so its tokens depend
neither on its neighbours nor on how the step runs (eagerly or in a CUDA graph);
others from torch's global CPU generator. Nothing here synchronises with the host.

Tensor legend: B sequences, K draft tokens, J = K + 1 verified positions, V vocabulary,
R = 2K + 1 uniform numbers per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from miles_host.rollout.sampler import SamplingBatch, inverse_cdf, seeded_uniforms, truncation_mask
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
    """``(probs_BJV, logprobs_BJV)``: the distribution sampled from, and the logprobs reported.

    Which steps run is decided by the host flags of ``rows`` (``all_greedy``, ``any_greedy``,
    ``all_unit_temperature``, which truncations are set), never by reading device values.
    """
    logits_BJV = logits_BJV.float()
    batch, positions, vocab = logits_BJV.shape
    greedy_B1 = rows.greedy_B[:, None]
    scaled_BJV = logits_BJV
    if not rows.all_unit_temperature:  # (a division by 1 is exact: greedy rows are unchanged)
        scaled_BJV = logits_BJV / torch.where(greedy_B1, 1.0, rows.temperature_B[:, None])[..., None]
    logprobs_BJV = torch.log_softmax(scaled_BJV, dim=-1)
    choice_BJV = logits_BJV if banned_BJV is None else logits_BJV.masked_fill(banned_BJV, float("-inf"))
    if rows.all_greedy:
        return _one_hot_argmax(choice_BJV), logprobs_BJV
    flat = logprobs_BJV.reshape(batch * positions, vocab)

    def repeat(values):
        return None if values is None else values.repeat_interleave(positions)

    keep = truncation_mask(flat, repeat(rows.top_k_B), repeat(rows.top_p_B), repeat(rows.min_p_B))
    sampled_BJV = logprobs_BJV if keep is None else logprobs_BJV.masked_fill(~keep.view_as(logprobs_BJV), float("-inf"))
    if banned_BJV is not None:
        sampled_BJV = sampled_BJV.masked_fill(banned_BJV, float("-inf"))
    probs_BJV = torch.softmax(sampled_BJV, dim=-1)
    if rows.any_greedy:
        probs_BJV = torch.where(greedy_B1[..., None], _one_hot_argmax(choice_BJV), probs_BJV)
    return probs_BJV, logprobs_BJV


def _one_hot_argmax(logits_BJV: torch.Tensor) -> torch.Tensor:
    """``[B, J, V]`` float32 one-hot of each row's argmax."""
    return torch.zeros_like(logits_BJV).scatter_(-1, logits_BJV.argmax(-1, keepdim=True), 1.0)


def step_uniforms(seqs, num_steps: int) -> np.ndarray:
    """``[B, 2K + 1]`` float64 (float32 values) ``U[0, 1)`` numbers of one speculative step:
    ``K`` to draw the drafts, ``K`` to accept them, one for the correction or bonus token.

    A seeded sequence draws number ``r`` from stream ``sample_index ^ (r + 1) << 32`` at its
    output position at the step's start: positions only grow from step to step, so no
    number is used twice, and the streams are apart from the plain sampler's (stream
    ``sample_index``). Unseeded rows use torch's global CPU generator.
    """
    width = 2 * num_steps + 1
    out = np.empty((len(seqs), width), dtype=np.float64)
    seeded = [b for b, seq in enumerate(seqs) if seq.params.sampling_seed is not None]
    if len(seeded) < len(seqs):
        out[:] = torch.rand(len(seqs), width).double().numpy()
    if seeded:
        chosen = [seqs[b] for b in seeded]
        seeds = np.array([seq.params.sampling_seed for seq in chosen], dtype=object)  # any Python int
        indices = np.array([seq.sample_index for seq in chosen], dtype=np.int64)
        positions = np.array([seq.num_output_tokens for seq in chosen], dtype=np.int64)
        streams_SR = indices[:, None] ^ (np.arange(1, width + 1, dtype=np.int64) << 32)
        out[seeded] = seeded_uniforms(
            np.repeat(seeds, width).tolist(), streams_SR.ravel().tolist(), np.repeat(positions, width).tolist()
        ).reshape(len(seeded), width)
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
    accept_uniforms_BK: torch.Tensor,
    extra_uniforms_B: torch.Tensor,
) -> Verdict:
    """Speculative sampling of one verify step (see the module docstring): draft ``j`` is
    accepted when ``u_j * q_j(d_j) < p_j(d_j)``; the extra token inverts the residual's
    (or the bonus distribution's) CDF at ``extra_uniforms_B``."""
    batch, num_drafts = draft_tokens_BK.shape
    index_BK1 = draft_tokens_BK[..., None]
    p_BK = target_probs_BJV[:, :num_drafts].gather(-1, index_BK1).squeeze(-1)
    q_BK = draft_probs_BKV.gather(-1, index_BK1).squeeze(-1)
    accepted_BK = accept_uniforms_BK * q_BK < p_BK
    num_accepted_B = accepted_BK.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(batch, device=p_BK.device)
    # The distribution of the emitted extra token: residual at the first rejection, else the bonus.
    target_BV = target_probs_BJV[rows, num_accepted_B]
    rejected_B1 = (num_accepted_B < num_drafts)[:, None]
    draft_BV = draft_probs_BKV[rows, num_accepted_B.clamp_max(num_drafts - 1)] * rejected_B1
    residual_BV = (target_BV - draft_BV).clamp_min(0)
    empty_B1 = residual_BV.sum(-1, keepdim=True) <= 0
    extra_B = inverse_cdf(torch.where(empty_B1, target_BV, residual_BV), extra_uniforms_B)
    tokens_BJ = torch.cat([draft_tokens_BK, torch.zeros_like(draft_tokens_BK[:, :1])], dim=1)
    tokens_BJ.scatter_(1, num_accepted_B[:, None], extra_B[:, None])
    logprobs_BJ = target_logprobs_BJV.gather(-1, tokens_BJ[..., None]).squeeze(-1)
    return Verdict(num_accepted_B, tokens_BJ, logprobs_BJ)
