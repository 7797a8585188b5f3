"""The draw of a few decode rows in two launches: :func:`fused_sample`.

:func:`~miles_host.rollout.sampler.sample_with_distribution` builds the whole ``[B, V]``
log-softmax (a max, a sum, a subtraction, an exponential over the vocabulary) and inverts
the CDF in two levels (chunk sums, their running sum, a search, the chosen chunk's scan, the
argmax fallbacks): some forty PyTorch kernels per decode step, each a full pass or a tiny
launch. For rows without truncation (no top-k, top-p or min-p, no banned tokens, no logits
processing: what the sampling graphs replay most) the same draw takes two Triton launches:

1. per ``(row, chunk of CDF_CHUNK tokens)``: the chunk's max of ``logits / T``, its sum of
   ``exp(logits / T - max)`` and its largest raw logit (first index);
2. per row: the log-sum-exp from those, each chunk's probability mass, their running sum,
   the chunk whose running sum passes ``u * total``, the scan of that chunk's probabilities,
   and the token with ``log_softmax(logits / T)`` at it. Greedy rows take the argmax (their
   temperature is 1); a target the scans round past falls back to the heaviest token, as in
   :func:`~miles_host.rollout.sampler.inverse_cdf`.

The draw is the same inversion of the same CDF at the same uniform: tokens agree with the
PyTorch path except where ``u * total`` lies within float32 rounding of a CDF step;
log-probabilities agree to float32 rounding (sums in another order). The reference is the
PyTorch path itself (``tests/kernels/test_fused_sampler.py`` also checks every token against the
float64 CDF). ``--sampler-kernel triton`` (the default) runs it where Triton does; ``torch`` keeps
the PyTorch sampler everywhere. Measured on an H100 (bf16 Qwen3-30B-A3B shape, 8 layers, batch-1
decode in CUDA graphs): 1,033 against 950 tok/s alone, 1,154 against 1,052 with the other decode
switches on (bench/history/2026-12-06-6.md).

Tensor legend: B rows, V vocabulary, C chunks.
"""

from __future__ import annotations

import torch

from miles_host.kernels import switches

#: tokens per chunk of the two-level CDF (:data:`miles_host.rollout.sampler.CDF_CHUNK`'s value)
CHUNK = 1024

#: ``--sampler-kernel``: ``triton`` (:func:`fused_sample` for the rows it takes) or ``torch``
SAMPLER = switches.declare_host("sampler_kernel")


def enabled(logits_BV: torch.Tensor) -> bool:
    """Whether :func:`fused_sample` runs for these logits: ``--sampler-kernel triton`` and Triton
    runs here (CUDA, or the interpreter in tests)."""
    from miles_host.kernels.invariant_matmul import uses_triton

    return switches.value(SAMPLER) == "triton" and uses_triton(logits_BV) and logits_BV.dim() == 2


def fused_sample(logits_BV: torch.Tensor, temperature_B: torch.Tensor, greedy_B: torch.Tensor,
                 uniforms_B: torch.Tensor, unit_temperature: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [B] int64, log_softmax(logits / T)[token] [B] float32)`` (see the module doc).

    ``temperature_B`` float32 (1 on greedy rows), ``greedy_B`` bool, ``uniforms_B`` in ``[0, 1)``
    (ignored on greedy rows); ``unit_temperature``: every row's temperature is 1 (no division)."""
    import triton

    from miles_host.kernels._sampling_triton import _chunk_stats_kernel, _draw_kernel

    batch, vocab = logits_BV.shape
    logits_BV = logits_BV if logits_BV.stride(-1) == 1 else logits_BV.contiguous()
    num_chunks = triton.cdiv(vocab, CHUNK)
    device = logits_BV.device
    chunk_max = torch.empty(batch, num_chunks, dtype=torch.float32, device=device)
    chunk_sum = torch.empty_like(chunk_max)
    chunk_top_value = torch.empty_like(chunk_max)
    chunk_top = torch.empty(batch, num_chunks, dtype=torch.int32, device=device)
    tokens_B = torch.empty(batch, dtype=torch.int64, device=device)
    logprobs_B = torch.empty(batch, dtype=torch.float32, device=device)
    if batch == 0:
        return tokens_B, logprobs_B
    temperature_B = temperature_B.float().contiguous()
    _chunk_stats_kernel[(batch, num_chunks)](
        logits_BV, temperature_B, chunk_max, chunk_sum, chunk_top, chunk_top_value,
        vocab, logits_BV.stride(0), num_chunks, CHUNK=CHUNK, UNIT=unit_temperature, num_warps=4,
    )
    _draw_kernel[(batch,)](
        logits_BV, temperature_B, greedy_B.contiguous(), uniforms_B.float().contiguous(), chunk_max, chunk_sum,
        chunk_top, chunk_top_value, tokens_B, logprobs_B, vocab, logits_BV.stride(0), num_chunks,
        CHUNK=CHUNK, CHUNKS_P=max(16, triton.next_power_of_2(num_chunks)), UNIT=unit_temperature, num_warps=8,
    )
    return tokens_B, logprobs_B


__all__ = ["CHUNK", "SAMPLER", "enabled", "fused_sample"]
