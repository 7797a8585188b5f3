"""Masked reductions over packed response tokens.

Every tensor suffixed ``_N`` below is a flat concatenation of the response tokens
of several sequences (``response_lengths`` says where each one ends); ``_S`` is
one value per sequence. Masks are float tensors of 0/1 the same shape as their
values. These helpers keep the input dtype so that float64 tests stay exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from miles_host.devices import host_to_device


def check_packed(response_lengths: Sequence[int], num_tokens: int) -> None:
    """Raise ``ValueError`` unless ``response_lengths`` sums to ``num_tokens``."""
    if any(length < 0 for length in response_lengths):
        raise ValueError(f"response_lengths must be non-negative, got {list(response_lengths)}")
    if sum(response_lengths) != num_tokens:
        raise ValueError(
            f"response_lengths sum to {sum(response_lengths)} but the packed tensors have "
            f"{num_tokens} tokens; pass one length per sequence of the micro-batch"
        )


def sequence_index(response_lengths: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """Long tensor ``[N]``: for each packed token, the index of its sequence."""
    lengths_S = torch.as_tensor(list(response_lengths), dtype=torch.long)
    index_N = torch.repeat_interleave(torch.arange(len(lengths_S)), lengths_S)  # on the host: no device read
    return index_N if device is None else host_to_device(index_N, device)


def per_sequence_sum(values_N: torch.Tensor, response_lengths: Sequence[int]) -> torch.Tensor:
    """Sum of each sequence's tokens, ``[S]`` (differentiable)."""
    index_N = sequence_index(response_lengths, values_N.device)
    zeros_S = values_N.new_zeros(len(response_lengths))
    return zeros_S.index_add(0, index_N, values_N)


def per_sequence_masked_mean(
    values_N: torch.Tensor, mask_N: torch.Tensor, response_lengths: Sequence[int]
) -> torch.Tensor:
    """``sum(x * m) / max(sum(m), 1)`` per sequence, ``[S]``.

    A fully masked sequence contributes 0, as in slime's ``sum_of_sample_mean``.
    """
    numerator_S = per_sequence_sum(values_N * mask_N, response_lengths)
    denominator_S = per_sequence_sum(mask_N.to(values_N.dtype), response_lengths).clamp_min(1)
    return numerator_S / denominator_S


def broadcast_to_tokens(values_S: torch.Tensor, response_lengths: Sequence[int]) -> torch.Tensor:
    """Repeat each per-sequence value over that sequence's tokens, ``[N]``."""
    return values_S[sequence_index(response_lengths, values_S.device)]


def masked_mean(values_N: torch.Tensor, mask_N: torch.Tensor) -> torch.Tensor:
    """``sum(x * m) / max(sum(m), 1)`` over all tokens (0 when nothing is masked in)."""
    return (values_N * mask_N).sum() / mask_N.to(values_N.dtype).sum().clamp_min(1)


def masked_whiten(values_N: torch.Tensor, mask_N: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Whiten with the masked mean and masked unbiased variance: ``(x - mu) / sqrt(var + eps)``.

    Same statistics as slime's ``distributed_masked_whiten(shift_mean=True)``
    (Bessel's correction when at least two tokens count, ``eps`` inside the root),
    computed here over the tokens given; a caller that shards a batch over ranks
    must pass the whole batch. Every token is transformed, masked out or not. The
    statistics are taken in float64 (float32 squares of values near 1e20 overflow); the
    result has the input's dtype.
    """
    values64_N, mask64_N = values_N.double(), mask_N.double()
    count = mask64_N.sum()
    if count.item() == 0:
        raise ValueError("cannot whiten advantages: the loss mask selects no token")
    mean = (values64_N * mask64_N).sum() / count
    squared_error = ((values64_N - mean) ** 2 * mask64_N).sum()
    variance = squared_error / (count - 1) if count.item() >= 2 else squared_error / count
    return ((values64_N - mean) * torch.rsqrt(variance + eps)).to(values_N.dtype)
