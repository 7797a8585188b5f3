"""Triton bodies of :mod:`miles_host.kernels.invariant_reduce` (imported only where Triton runs).

One program per row, looping over the row in fixed ``BLOCK`` chunks from column
0; ``BLOCK`` and ``num_warps`` depend on the row length only, so a row's
reduction order never depends on the other rows. Under the interpreter
(``EMULATE``) the chunk loop runs a host-computed trip count (numpy 2.4 cannot
take ``range`` of the interpreter's runtime scalars; on the GPU the length stays
a runtime argument, so new lengths do not recompile), the downcast rounds by
integer arithmetic and tanh is built from exp (no libdevice there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from miles_host.kernels._split_k_triton import cast_rne, emulate_rounding

#: the widest chunk of a row (elements); shorter rows take the next power of two
MAX_BLOCK = 4096


def block_for(length: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` of a row of ``length`` elements (a function of the length only)."""
    block = min(MAX_BLOCK, triton.next_power_of_2(max(length, 1)))
    return block, 4 if block <= 2048 else 8


def _trip_count(length: int, block: int, emulate: bool) -> int:
    return triton.cdiv(length, block) if emulate else 0


# ----------------------------------------------------------------------------- row mean


@triton.jit
def _sum_chunk(acc, row_ptr, c, L, BLOCK: tl.constexpr):
    cols = c * BLOCK + tl.arange(0, BLOCK)
    return acc + tl.load(row_ptr + cols, mask=cols < L, other=0.0).to(tl.float32)


@triton.jit
def _row_mean_kernel(X, Out, L, stride_row, EMULATE: tl.constexpr, EMULATED_CHUNKS: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = X + row * stride_row
    acc = tl.zeros((BLOCK,), dtype=tl.float32)  # lane j sums columns j, j + BLOCK, ... in order
    if EMULATE:
        for c in range(0, EMULATED_CHUNKS):
            acc = _sum_chunk(acc, row_ptr, c, L, BLOCK)
    else:
        for c in range(0, tl.cdiv(L, BLOCK)):
            acc = _sum_chunk(acc, row_ptr, c, L, BLOCK)
    mean = tl.math.div_rn(tl.sum(acc, axis=0), L.to(tl.float32))
    tl.store(Out + row, cast_rne(mean, Out.dtype.element_ty, EMULATE))


def row_mean(x_RL: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Mean of each row of ``x_RL`` (last-dim stride 1) as ``[R]`` of ``out_dtype``."""
    rows, length = x_RL.shape
    out_R = torch.empty(rows, dtype=out_dtype, device=x_RL.device)
    if rows:
        block, num_warps = block_for(length)
        emulate = emulate_rounding()
        _row_mean_kernel[(rows,)](
            x_RL, out_R, length, x_RL.stride(0),
            EMULATE=emulate, EMULATED_CHUNKS=_trip_count(length, block, emulate), BLOCK=block, num_warps=num_warps,
        )
    return out_R


# ----------------------------------------------------------------------------- log-probs


@triton.jit
def _tanh(y, EMULATE: tl.constexpr):
    if EMULATE:
        e = tl.exp(-2.0 * tl.abs(y))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(y < 0, -t, t)
    else:
        return libdevice.tanh(y)


@triton.jit
def _scaled(x, temperature, softcap, HAS_SOFTCAP: tl.constexpr, EMULATE: tl.constexpr):
    """float32 logits -> ``tanh(x / softcap) * softcap`` (if capped) ``/ temperature``."""
    if HAS_SOFTCAP:
        x = _tanh(tl.math.div_rn(x, softcap), EMULATE) * softcap
    return tl.math.div_rn(x, temperature)


@triton.jit
def _lse_chunk(m, s, t, row_ptr, c, V, stride_v, temperature, softcap,
               HAS_SOFTCAP: tl.constexpr, WITH_ENTROPY: tl.constexpr, EMULATE: tl.constexpr, BLOCK: tl.constexpr):
    """Fold one chunk into the running ``(max m, s = sum e^(x - m), t = sum e^(x - m) (x - m))``.

    ``-inf`` logits (masked vocabulary) add nothing; an all ``-inf`` prefix leaves
    ``s = t = 0`` (``m_safe`` keeps the exponent finite).
    """
    cols = c * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=mask, other=0.0).to(tl.float32)
    x = tl.where(mask, _scaled(x, temperature, softcap, HAS_SOFTCAP, EMULATE), float("-inf"))
    m_new = tl.maximum(m, tl.max(x, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(x - m_safe)
    if WITH_ENTROPY:
        # t relative to the new max: e^(m - m_new) (t + (m - m_new) s); guarded where s = 0, p = 0
        shift = tl.where(s > 0, m - m_safe, 0.0) * s
        t = alpha * (t + shift) + tl.sum(p * tl.where(p > 0, x - m_safe, 0.0), axis=0)
    s = alpha * s + tl.sum(p, axis=0)
    return m_new, s, t


@triton.jit
def _log_probs_kernel(
    Logits, Targets, LogProbs, Entropy,
    V, stride_row, stride_v, temperature, softcap,
    HAS_SOFTCAP: tl.constexpr, WITH_ENTROPY: tl.constexpr, EMULATE: tl.constexpr, EMULATED_CHUNKS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = Logits + row * stride_row
    m = tl.max(tl.full((BLOCK,), float("-inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
    t = s
    if EMULATE:
        for c in range(0, EMULATED_CHUNKS):
            m, s, t = _lse_chunk(m, s, t, row_ptr, c, V, stride_v, temperature, softcap,
                                 HAS_SOFTCAP, WITH_ENTROPY, EMULATE, BLOCK)
    else:
        for c in range(0, tl.cdiv(V, BLOCK)):
            m, s, t = _lse_chunk(m, s, t, row_ptr, c, V, stride_v, temperature, softcap,
                                 HAS_SOFTCAP, WITH_ENTROPY, EMULATE, BLOCK)
    log_s = tl.log(s)
    target = tl.load(Targets + row).to(tl.int64)
    valid = (target >= 0) & (target < V)
    x_t = tl.load(row_ptr + tl.where(valid, target, 0) * stride_v).to(tl.float32)
    x_t = _scaled(x_t, temperature, softcap, HAS_SOFTCAP, EMULATE)
    tl.store(LogProbs + row, tl.where(valid, x_t - m - log_s, float("nan")))
    if WITH_ENTROPY:
        tl.store(Entropy + row, log_s - t / s)


def log_probs(logits_TV: torch.Tensor, targets_T: torch.Tensor, temperature: float, softcap: float | None,
              return_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch one program per row (shapes checked by the caller)."""
    rows, vocab = logits_TV.shape
    log_probs_T = torch.empty(rows, dtype=torch.float32, device=logits_TV.device)
    entropy_T = torch.empty(rows, dtype=torch.float32, device=logits_TV.device) if return_entropy else None
    if rows:
        block, num_warps = block_for(vocab)
        emulate = emulate_rounding()
        _log_probs_kernel[(rows,)](
            logits_TV, targets_T, log_probs_T, entropy_T if entropy_T is not None else log_probs_T,
            vocab, logits_TV.stride(0), logits_TV.stride(1), float(temperature), float(softcap or 1.0),
            HAS_SOFTCAP=softcap is not None, WITH_ENTROPY=return_entropy,
            EMULATE=emulate, EMULATED_CHUNKS=_trip_count(vocab, block, emulate), BLOCK=block, num_warps=num_warps,
        )
    return log_probs_T, entropy_T
