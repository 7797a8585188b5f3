"""Grouped-query attention variants of gpt-oss and Llama-4.

- **attention sinks** (gpt-oss): a learned logit per query head joins every
  softmax as one extra column whose probability is dropped, so a query may give
  part of its attention to "nothing" (:func:`attend_dense_with_sinks`);
- **chunked local attention** (Llama-4): a query at position ``p`` sees only the
  keys of its own chunk ``p // attention_chunk_size`` (a mask; the KV cache keeps
  every key);
- **NoPE layers** (Llama-4): no rotary on those layers; with ``attn_temperature``
  their queries are scaled by ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))``,
  which needs the token positions: such layers get a :class:`PositionTable`
  (positions instead of cos/sin) through the model's rotary tables;
- **L2 q/k norm** (Llama-4, ``qk_norm="l2"``): a weightless RMS norm of each
  head of q and k after the rotary, on rotary layers only.

The blocks hand ``sinks`` and ``chunk_size`` to the forward's attention context
(packed training, the reference cache, the engine's paged cache, the
batch-invariant contexts of ``--true-on-policy``, which stays exact); a context
without them is refused with the reason. Tensor legend: S sequences, T tokens, H hidden,
N heads, D head dim, L query length, M key length.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miles_host.kernels.eager_ops import apply_rotary
from miles_host.models.config import ModelConfig, RopeConfig
from miles_host.models.context import AttentionContext
from miles_host.models.rope import RotaryEmbedding
from miles_host.models.self_attention import GQAAttention


#: zero dims appended to q and k for the sink key (its score rides on the first; 8 keeps the
#: head dim a multiple of 8 for the GPU kernels when it was one)
SINK_KEY_DIMS = 8


def attend_dense_with_sinks(
    q_SNLD: torch.Tensor,
    k_SNMD: torch.Tensor,
    v_SNMD: torch.Tensor,
    mask_LM: torch.Tensor,
    sinks_N: torch.Tensor,
    *,
    scale: float,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Attention whose softmax has one extra column per head, the sink logit ``sinks_N[h]``.

    ``mask_LM``: which keys each query sees. The sink's probability is dropped, so
    the weights of a row sum to less than one. Keys and values are expanded to the
    query heads. With soft-capping: scores and softmax in float32 (the transformers
    "eager" formula). Without: plain SDPA (memory-efficient kernels on GPU) over one
    more key per query head, visible to all, with value zero: queries are extended by
    ``[1, 0, ..]``, keys by zeros (real scores unchanged) and the sink key is
    ``[0, .., 0, sinks[h] / scale, 0, ..]``, so ``scale * q . k_sink = sinks[h]`` (exact
    when ``scale`` is a power of two, e.g. head dim 64; else one rounding of
    ``sinks / scale``). Gradients reach the sinks through that key.
    """
    num_seqs, num_heads, _, head_dim = q_SNLD.shape
    group = num_heads // k_SNMD.shape[1]
    if group > 1:
        k_SNMD = k_SNMD.repeat_interleave(group, dim=1)
        v_SNMD = v_SNMD.repeat_interleave(group, dim=1)
    if logit_softcap is not None:
        scores = torch.matmul(q_SNLD.float(), k_SNMD.float().transpose(2, 3)) * scale
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
        scores = scores.masked_fill(~mask_LM, float("-inf"))
        sink_column = sinks_N.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat((scores, sink_column), dim=-1), dim=-1)[..., :-1]
        return torch.matmul(probs.to(v_SNMD.dtype), v_SNMD)
    dtype = q_SNLD.dtype
    extra_q = torch.zeros(SINK_KEY_DIMS, dtype=dtype, device=q_SNLD.device)
    extra_q[0] = 1.0
    q_ext = torch.cat((q_SNLD, extra_q.expand(*q_SNLD.shape[:3], SINK_KEY_DIMS)), dim=-1)
    k_ext = torch.cat((k_SNMD, k_SNMD.new_zeros(*k_SNMD.shape[:3], SINK_KEY_DIMS)), dim=-1)
    sink_key = torch.cat((
        k_SNMD.new_zeros(num_seqs, num_heads, 1, head_dim),
        (sinks_N.float() / scale).to(dtype).view(1, num_heads, 1, 1).expand(num_seqs, num_heads, 1, 1),
        k_SNMD.new_zeros(num_seqs, num_heads, 1, SINK_KEY_DIMS - 1),
    ), dim=-1)
    keys = torch.cat((sink_key, k_ext), dim=2)
    values = torch.cat((v_SNMD.new_zeros(num_seqs, num_heads, 1, v_SNMD.shape[-1]), v_SNMD), dim=2)
    mask = torch.cat((mask_LM.new_ones(mask_LM.shape[0], 1), mask_LM), dim=1)
    return F.scaled_dot_product_attention(q_ext, keys, values, attn_mask=mask, scale=scale)


@dataclass
class PositionsOnly(RopeConfig):
    """The "rotary" of NoPE layers: their table is the token positions (:class:`PositionTable`)."""


class PositionTable(torch.nn.Module):
    """The rotary table of NoPE layers: ``(positions_T, None)`` instead of ``(cos, sin)``."""

    def __init__(self, rope: RopeConfig):
        super().__init__()
        self.rope = rope

    def forward(self, positions_T: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, None]:
        return positions_T, None


def rotary_module(rope: RopeConfig) -> torch.nn.Module:
    """The table module of one rope config: positions for :class:`PositionsOnly`, else cos/sin."""
    return PositionTable(rope) if isinstance(rope, PositionsOnly) else RotaryEmbedding(rope)


_EXTRA_KWARGS: dict[type, bool] = {}


def _takes_sinks_and_chunks(attention: AttentionContext) -> bool:
    kind = type(attention)
    if kind not in _EXTRA_KWARGS:
        parameters = inspect.signature(kind.attend).parameters
        _EXTRA_KWARGS[kind] = {"sinks", "chunk_size"} <= parameters.keys() or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
        )
    return _EXTRA_KWARGS[kind]


def l2_head_norm(x_TND: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS norm over each head (in float32, back to x's dtype)."""
    x = x_TND.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).type_as(x_TND)


class VariantGQAAttention(GQAAttention):
    """:class:`GQAAttention` with sinks, chunked local attention, NoPE, L2 q/k norm and
    NoPE temperature tuning (each as the config asks for this layer)."""

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__(config, layer_index)
        self.sinks = torch.nn.Parameter(torch.empty(self.num_heads)) if config.attn_sinks else None
        self.chunk_size = config.chunk_size_of(layer_index)
        self.use_rope = not config.nope_layers[layer_index]
        self.l2_qk_eps = config.rms_norm_eps if config.qk_norm == "l2" and self.use_rope else None
        self.temperature = config.attn_temperature if not self.use_rope else None
        if self.temperature is not None and not isinstance(config.rope_of(layer_index), PositionsOnly):
            raise ValueError("attn_temperature on NoPE layers needs their rope_of() to be PositionsOnly")

    def forward(self, x_TH: torch.Tensor, rope_cos_sin, attention: AttentionContext) -> torch.Tensor:
        num_tokens = x_TH.shape[0]
        q_TND, k_TND, v_TND = self.project_qkv(x_TH)
        if self.use_rope:
            cos, sin = rope_cos_sin
            q_TND = apply_rotary(q_TND, cos, sin, self.rope_interleaved)
            k_TND = apply_rotary(k_TND, cos, sin, self.rope_interleaved)
        if self.l2_qk_eps is not None:
            q_TND, k_TND = l2_head_norm(q_TND, self.l2_qk_eps), l2_head_norm(k_TND, self.l2_qk_eps)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            positions_T = rope_cos_sin[0]
            scales_T = torch.log1p(torch.floor((positions_T.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q_TND = (q_TND * scales_T[:, None, None]).to(q_TND.dtype)
        extra = {}
        if self.sinks is not None or self.chunk_size is not None:
            if not _takes_sinks_and_chunks(attention):
                raise ValueError(
                    f"the attention context {type(attention).__name__} takes no sinks / chunk_size, which "
                    f"{'the sinks' if self.sinks is not None else 'the chunked layers'} of this model need: "
                    "give its attend() those keyword arguments"
                )
            extra = dict(sinks=self.sinks, chunk_size=self.chunk_size)
        y_TND = attention.attend(
            self.layer_index, q_TND, k_TND, v_TND,
            scale=self.scale, sliding_window=self.sliding_window, logit_softcap=self.logit_softcap, **extra,
        )
        return self.o_proj(y_TND.reshape(num_tokens, -1))

    def forward_fused(self, x_TH: torch.Tensor, rope_cos_sin, attention: AttentionContext) -> torch.Tensor:
        """The eager forward (the fused q/k-norm + rotary kernel knows none of the variants)."""
        return self.forward(x_TH, rope_cos_sin, attention)


def needs_variant(config: ModelConfig) -> bool:
    """Whether the model's attention uses any variant of :class:`VariantGQAAttention`."""
    return bool(
        config.attn_sinks or config.attention_chunk_size or any(config.nope_layers) or config.qk_norm == "l2"
    )


def gqa_block(config: ModelConfig, layer_index: int) -> GQAAttention:
    """The grouped-query attention module of one decoder layer (a variant where the config asks)."""
    return VariantGQAAttention(config, layer_index) if needs_variant(config) else GQAAttention(config, layer_index)
