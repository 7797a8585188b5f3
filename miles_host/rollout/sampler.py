"""Token sampling without host synchronisation.

The returned logprob of a token is ``log_softmax(logits / temperature)`` at that
token (``log_softmax(logits)`` when greedy), taken before top-k / top-p / min-p
truncation: exactly what the trainer recomputes from the same logits. A request with
penalties, ``logit_bias`` or a grammar has its logits changed first
(:class:`~miles_host.rollout.penalties.LogitsProcessing`), and its logprobs are of the
changed distribution, as SGLang returns them. Stop tokens held back by ``min_new_tokens``
are excluded from the draw only, not from the returned logprobs (SGLang masks them in both;
here the logprobs stay the policy's, which speculative decoding reproduces).
A token is drawn by inverting the CDF of the truncated, renormalised distribution
at one uniform number per row (no ``.item()``, no ``multinomial``). A request
with a ``sampling_seed`` gets its uniform from a counter-based hash of (seed,
sample index, output position) computed on the host (:func:`seeded_uniform`),
so its tokens depend neither on the rest of the batch nor on how many steps ran
before, and the whole batch needs one small host-to-device copy instead of one
random-number kernel per seeded row.
:func:`exponential_noise` (the exponential race) stays for speculative decoding.

Tensor legend: B = rows (sequences being sampled), V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from miles_host.devices import host_to_device
from miles_host.rollout.sampling_params import SamplingParams

if TYPE_CHECKING:
    from miles_host.rollout.penalties import LogitsProcessing


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
    processing: "LogitsProcessing | None" = None  # penalties, grammar, logit_bias (None: logits as they are)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        banned: list[list[int]],
        device: torch.device,
        processing: "LogitsProcessing | None" = None,
    ) -> "SamplingBatch":
        def to_device(values, dtype):
            return host_to_device(torch.tensor(values, dtype=dtype), device)

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
            processing=processing,
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


#: tokens per chunk of :func:`inverse_cdf`'s two-level search
CDF_CHUNK = 1024


def inverse_cdf(weights_BV: torch.Tensor, uniforms_B: torch.Tensor) -> torch.Tensor:
    """One token per row of the non-negative ``weights_BV`` (normalised or not), drawn by
    inverting the row's CDF at ``uniforms_B`` (in ``[0, 1)``): the first token whose running
    sum exceeds ``u * total``. A zero-weight token is never drawn; a target rounded up to the
    total falls back to the heaviest token.

    Two levels, so that no scan runs over a whole vocabulary row (a [16, 151,936] cumsum is one
    thread block per row: ~0.2 ms on an H200, a tenth of a 0.6B model's decode step): chunk sums
    of ``CDF_CHUNK`` tokens, the chunk whose running sum passes the target, then the scan of that
    chunk only. The same draw as one scan up to float rounding of the running sums.
    """
    batch, vocab = weights_BV.shape
    if vocab <= CDF_CHUNK:
        cdf_BV = weights_BV.cumsum(dim=-1)
        index_B = torch.searchsorted(cdf_BV, uniforms_B[:, None] * cdf_BV[:, -1:], right=True)[:, 0]
        return torch.where(index_B < vocab, index_B, weights_BV.argmax(dim=-1))
    pad = -vocab % CDF_CHUNK
    chunks_BCL = torch.nn.functional.pad(weights_BV, (0, pad)).view(batch, -1, CDF_CHUNK)
    num_chunks = chunks_BCL.shape[1]
    chunk_cdf_BC = chunks_BCL.sum(dim=-1).cumsum(dim=-1)
    target_B1 = uniforms_B[:, None] * chunk_cdf_BC[:, -1:]
    chunk_B = torch.searchsorted(chunk_cdf_BC, target_B1, right=True)[:, 0]
    inside_B = chunk_B < num_chunks
    chunk_B = chunk_B.clamp_max(num_chunks - 1)
    before_B1 = torch.where(chunk_B[:, None] > 0, chunk_cdf_BC.gather(1, (chunk_B[:, None] - 1).clamp_min(0)), 0.0)
    rows_BL = chunks_BCL[torch.arange(batch, device=weights_BV.device), chunk_B]
    offset_B = torch.searchsorted(rows_BL.cumsum(dim=-1), target_B1 - before_B1, right=True)[:, 0]
    # the chunk's own scan may round below its sum: its heaviest token (positive: the chunk was passed)
    offset_B = torch.where(offset_B < CDF_CHUNK, offset_B, rows_BL.argmax(dim=-1))
    return torch.where(inside_B, chunk_B * CDF_CHUNK + offset_B, weights_BV.argmax(dim=-1))


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


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, stream: int, position: int) -> float:
    """A uniform number in ``[0, 1)`` (a multiple of 2**-24, exact in float32) determined by
    ``(seed, stream, position)`` alone (splitmix64 of the three, platform independent)."""
    x = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ (stream & _MASK64)) ^ (position & _MASK64))
    return (x >> 40) * 2.0**-24


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """:func:`_splitmix64` over a ``uint64`` array (numpy wraps modulo 2**64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def seeded_uniforms(seeds: list[int], streams: list[int], positions: list[int]) -> np.ndarray:
    """:func:`seeded_uniform` for many rows at once (``float32 [B]``, the same numbers)."""
    def u64(values: list[int]) -> np.ndarray:
        return np.array([v & _MASK64 for v in values], dtype=np.uint64)

    with np.errstate(over="ignore"):
        x = _splitmix64_array(_splitmix64_array(_splitmix64_array(u64(seeds)) ^ u64(streams)) ^ u64(positions))
    return ((x >> np.uint64(40)).astype(np.float64) * 2.0**-24).astype(np.float32)


def row_uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """``U[0, 1)`` ``[B]`` from each row's generator (the global one where None)."""
    uniforms_B = torch.rand(len(generators), device=device)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniforms_B[row] = torch.rand(1, device=device, generator=generator)[0]
    return uniforms_B


def sample(
    logits_BV: torch.Tensor, batch: SamplingBatch, uniforms_B: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (token ids ``[B]``, their logprobs ``[B]``) for one step, on device.

    ``uniforms_B``: the rows' ``U[0, 1)`` numbers (default: from ``batch.generators``).
    """
    tokens_B, logprobs_BV = sample_with_distribution(logits_BV, batch, uniforms_B)
    return tokens_B, logprobs_BV.gather(1, tokens_B[:, None]).squeeze(1)


#: rows up to which a CUDA log-softmax runs as ``x - logsumexp(x)``: PyTorch's log_softmax
#: kernel gives a row one thread block (~34 us for one 151,936-token row on an H200, the
#: largest kernel of a batch-1 sampling step), logsumexp's reductions spread a row over many
LOGSUMEXP_MAX_ROWS = 4


def log_softmax_rows(x_BV: torch.Tensor) -> torch.Tensor:
    """``log_softmax(x, dim=-1)``; for a few rows on CUDA as ``x - logsumexp(x)`` (see
    :data:`LOGSUMEXP_MAX_ROWS`): the same values up to float32 rounding."""
    if x_BV.is_cuda and x_BV.shape[0] <= LOGSUMEXP_MAX_ROWS:
        return x_BV - torch.logsumexp(x_BV, dim=-1, keepdim=True)
    return torch.log_softmax(x_BV, dim=-1)


def sample_with_distribution(
    logits_BV: torch.Tensor, batch: SamplingBatch, uniforms_B: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (token ids ``[B]``, the rows' logprobs ``[B, V]``): :func:`sample` with the whole
    distribution the returned logprobs come from (top logprobs are read from it)."""
    logits_BV = logits_BV.float()
    if batch.processing is not None:
        logits_BV = batch.processing.apply(logits_BV)
    choice_BV = logits_BV
    if any(batch.banned):
        choice_BV = logits_BV.clone()
        for row, token_ids in enumerate(batch.banned):
            if token_ids:
                choice_BV[row, token_ids] = float("-inf")
    if batch.all_greedy:
        return choice_BV.argmax(dim=-1), log_softmax_rows(logits_BV)
    scaled_BV = logits_BV if batch.all_unit_temperature else logits_BV / batch.temperature_B[:, None]
    logprobs_BV = log_softmax_rows(scaled_BV)
    keep_BV = truncation_mask(logprobs_BV, batch.top_k_B, batch.top_p_B, batch.min_p_B)
    probs_BV = logprobs_BV.exp()
    if keep_BV is not None:
        probs_BV = probs_BV.masked_fill(~keep_BV, 0.0)
    for row, token_ids in enumerate(batch.banned):
        if token_ids:
            probs_BV[row, token_ids] = 0.0
    if uniforms_B is None:
        uniforms_B = row_uniforms(batch.generators, logits_BV.device)
    tokens_B = inverse_cdf(probs_BV, uniforms_B.to(probs_BV.dtype))
    if batch.any_greedy:
        # (a greedy row's temperature is 1: its logprobs are log_softmax(logits), untempered)
        tokens_B = torch.where(batch.greedy_B, choice_BV.argmax(dim=-1), tokens_B)
    return tokens_B, logprobs_BV
