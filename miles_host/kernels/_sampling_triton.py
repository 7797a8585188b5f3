"""Triton kernels of :mod:`miles_host.kernels.fused_sampler` (imported only where Triton runs).

- :func:`_chunk_stats_kernel`, program ``(row, chunk)``: over ``CHUNK`` logits of a row, the max of
  ``logits / temperature``, the sum of ``exp(logits / temperature - max)``, and the first index of
  the largest raw logit with its value.
- :func:`_draw_kernel`, program ``row``: the row's log-sum-exp from the chunk statistics, the chunk
  masses and their running sum, the chunk whose running sum passes ``u * total``, the scan of that
  chunk's probabilities, the token (the argmax for greedy rows and where the scan falls short) and
  its log-probability.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _scaled(x, temperature, UNIT: tl.constexpr):
    """``x / temperature`` rounded as torch's float32 division (exact with ``UNIT``)."""
    if UNIT:
        return x
    else:
        return tl.math.div_rn(x, temperature)


@triton.jit
def _chunk_stats_kernel(
    Logits, Temperature, ChunkMax, ChunkSum, ChunkTop, ChunkTopValue,
    V, stride_lb, num_chunks,
    CHUNK: tl.constexpr, UNIT: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < V
    x = tl.load(Logits + row.to(tl.int64) * stride_lb + offs, mask=valid, other=float("-inf")).to(tl.float32)
    scaled = _scaled(x, tl.load(Temperature + row), UNIT)
    high = tl.max(scaled, axis=0)
    total = tl.sum(tl.where(valid, tl.exp(scaled - high), 0.0), axis=0)
    top_value = tl.max(x, axis=0)
    top = tl.min(tl.where(x == top_value, offs, V), axis=0)  # the first index of the largest logit
    slot = row * num_chunks + chunk
    tl.store(ChunkMax + slot, high)
    tl.store(ChunkSum + slot, total)
    tl.store(ChunkTop + slot, top)
    tl.store(ChunkTopValue + slot, top_value)


@triton.jit
def _draw_kernel(
    Logits, Temperature, Greedy, Uniforms, ChunkMax, ChunkSum, ChunkTop, ChunkTopValue, Tokens, Logprobs,
    V, stride_lb, num_chunks,
    CHUNK: tl.constexpr, CHUNKS_P: tl.constexpr, UNIT: tl.constexpr,
):
    row = tl.program_id(0)
    base = Logits + row.to(tl.int64) * stride_lb
    temperature = tl.load(Temperature + row)
    c = tl.arange(0, CHUNKS_P)
    c_ok = c < num_chunks
    slot = row * num_chunks + c
    highs = tl.load(ChunkMax + slot, mask=c_ok, other=float("-inf"))
    sums = tl.load(ChunkSum + slot, mask=c_ok, other=0.0)
    high = tl.max(highs, axis=0)
    lse = high + tl.log(tl.sum(sums * tl.exp(highs - high), axis=0))
    # the heaviest token: the first chunk holding the largest logit, its first index of it
    top_values = tl.load(ChunkTopValue + slot, mask=c_ok, other=float("-inf"))
    best = tl.max(top_values, axis=0)
    best_chunk = tl.min(tl.where(top_values == best, c, CHUNKS_P), axis=0)
    heaviest = tl.load(ChunkTop + row * num_chunks + best_chunk)

    masses = tl.where(c_ok, sums * tl.exp(highs - lse), 0.0)  # each chunk's share of the distribution
    cumulative = tl.cumsum(masses, axis=0)
    total = tl.max(cumulative, axis=0)  # the running sum's last value (non-decreasing), not a tree sum
    target = tl.load(Uniforms + row) * total
    chunk = tl.sum((c_ok & (cumulative <= target)).to(tl.int32), axis=0)  # the first chunk past the target
    inside = chunk < num_chunks
    chunk = tl.minimum(chunk, num_chunks - 1)
    before = tl.sum(tl.where(c == chunk - 1, cumulative, 0.0), axis=0)

    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < V
    x = tl.load(base + offs, mask=valid, other=float("-inf")).to(tl.float32)
    probs = tl.where(valid, tl.exp(_scaled(x, temperature, UNIT) - lse), 0.0)
    running = tl.cumsum(probs, axis=0)
    # the target's place inside the chunk, on the scale of the chunk's own scan (whose total rounds
    # apart from the chunk's mass): a target inside the chunk lands inside its scan
    mass = tl.sum(tl.where(c == chunk, masses, 0.0), axis=0)
    inner = (target - before) * (tl.max(running, axis=0) / mass)
    offset = tl.sum((valid & (running <= inner)).to(tl.int32), axis=0)
    chunk_top = tl.load(ChunkTop + row * num_chunks + chunk)  # the scan rounded below its sum: the chunk's heaviest
    token = tl.where(offset < tl.sum(valid.to(tl.int32), axis=0), chunk * CHUNK + offset, chunk_top)
    token = tl.where(inside, token, heaviest)
    token = tl.where(tl.load(Greedy + row) != 0, heaviest, token)
    logit = tl.load(base + token).to(tl.float32)
    tl.store(Tokens + row, token.to(tl.int64))
    tl.store(Logprobs + row, _scaled(logit, temperature, UNIT) - lse)
