"""Rotary position embeddings: default, linear, llama3 and yarn scaling.

The frequency formulas follow transformers' ``modeling_rope_utils`` so logits
match the HF implementations bit for bit in float32. Tensor legend: T tokens,
H heads, D head dim, R rotary dim / 2.
"""

from __future__ import annotations

import math

import torch

from miles_host.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """Return ``(inv_freq_R, attention_factor)`` for one rope config (float32, CPU)."""
    dim = rope.rotary_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    return _yarn(rope)


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    dim, base, factor = rope.rotary_dim, rope.theta, rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    original = rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast or 32), correction_dim(rope.beta_slow or 1)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def yarn_softmax_scale_factor(rope: RopeConfig) -> float:
    """DeepSeek's extra softmax scale ``mscale(factor, mscale_all_dim) ** 2`` under yarn."""
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = _yarn_mscale(rope.factor, rope.mscale_all_dim)
        return m * m
    return 1.0


class RotaryEmbedding(torch.nn.Module):
    """Computes ``(cos_TR, sin_TR)`` for token positions; holds no state dict entries.

    :meth:`cache_table` keeps the rows of every position below a bound on one device: a forward
    captured in a CUDA graph (the engine's decode graphs, whose positions all have a KV-cache slot
    below that bound) then gathers its tokens' rows, one launch each for cos and sin, instead of
    computing them (a cast, a product, cos, sin and two casts: plain launches between the graph's
    dependent ones). The rows are the same bits: each is the same elementwise computation."""

    def __init__(self, rope: RopeConfig):
        super().__init__()
        self.rope = rope
        with torch.device("cpu"):  # also when the model is built on the meta device
            inv_freq, self.attention_factor = inverse_frequencies(rope)
        self._inv_freq_cpu = inv_freq
        self._inv_freq: torch.Tensor | None = None
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None

    def cache_table(self, max_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        """Keep ``cos, sin`` of positions ``[0, max_positions)`` on ``device`` in ``dtype``."""
        self._table = self._compute(torch.arange(max_positions, device=device), dtype)

    def forward(self, positions_T: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``cos, sin`` of shape ``[T, R]`` in ``dtype`` (attention factor applied)."""
        table = self._table
        if (table is not None and positions_T.is_cuda and torch.cuda.is_current_stream_capturing()
                and table[0].device == positions_T.device and table[0].dtype == dtype):
            return self.lookup(positions_T)
        return self._compute(positions_T, dtype)

    def lookup(self, positions_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached rows of ``positions_T`` (all below the table's bound)."""
        cos, sin = self._table
        return cos.index_select(0, positions_T), sin.index_select(0, positions_T)

    def _compute(self, positions_T: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq is None or self._inv_freq.device != positions_T.device:
            self._inv_freq = self._inv_freq_cpu.to(positions_T.device)
        freqs_TR = positions_T[:, None].float() * self._inv_freq[None, :]
        cos_TR, sin_TR = freqs_TR.cos(), freqs_TR.sin()
        if self.attention_factor != 1.0:
            cos_TR, sin_TR = cos_TR * self.attention_factor, sin_TR * self.attention_factor
        return cos_TR.to(dtype), sin_TR.to(dtype)
