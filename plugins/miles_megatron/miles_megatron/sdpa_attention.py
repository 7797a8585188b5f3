"""Megatron's core attention on torch's ``scaled_dot_product_attention``.

Without TransformerEngine, Megatron-Core's local layer spec computes attention in
``DotProductAttention``: every head's ``[S, S]`` scores materialised (``baddbmm``), a
masked softmax, a ``bmm`` with the values, each a pass over ``B * heads * S * S``
elements, and the probabilities kept for backward. TransformerEngine's flash attention,
which Megatron's production spec uses, is not importable here; torch's SDPA is the flash
attention that is (flash / memory-efficient kernels on CUDA, the math path on the CPU).
:class:`SdpaAttention` is ``DotProductAttention`` whose forward is one causal SDPA call.

The backend's batches are padded ``[S, B]`` rows, one sequence per row, padding at the end
(:class:`~miles_megatron.layout.PaddedLayout`), and the mask the decoder is given is the
causal one (``PaddedLayout.causal_mask``): so ``is_causal`` is that mask, and no real
token sees padding. :func:`with_sdpa_attention` puts it in a decoder block spec where the
attention is plain: causal, no sliding window, no query-key layer scaling, the vanilla
softmax. Multi-latent attention and context parallelism keep their own core attention
(:mod:`miles_megatron.mla_spec`, :mod:`miles_megatron.context_parallel`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from miles_megatron.mla_spec import replace_core_attention


class SdpaAttention(DotProductAttention):
    """``DotProductAttention`` as one causal ``scaled_dot_product_attention`` (see module doc)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        """``[sq, b, np * hn]`` from ``query [sq, b, np, hn]`` and ``key`` / ``value`` ``[sk, b, ng, hn]``
        (``attention_mask``: the causal mask, which ``is_causal`` stands for)."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SdpaAttention takes the padded causal layout only (no packed_seq_params, no bias)")
        q_BNSD, k_BGSD, v_BGSD = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        dropout = self.attention_dropout.p if self.training else 0.0
        out_BNSD = F.scaled_dot_product_attention(
            q_BNSD, k_BGSD, v_BGSD, is_causal=True, dropout_p=dropout, scale=self.softmax_scale,
            enable_gqa=q_BNSD.shape[1] != k_BGSD.shape[1],
        )
        seq_len, batch = query.shape[0], query.shape[1]
        return out_BNSD.permute(2, 0, 1, 3).reshape(seq_len, batch, self.hidden_size_per_partition)


def plain_attention(config: Any) -> bool:
    """Whether every layer's attention under ``config`` (a ``TransformerConfig``) is what
    :class:`SdpaAttention` computes (see module doc)."""
    return (not config.multi_latent_attention and config.context_parallel_size == 1 and config.window_size is None
            and not config.apply_query_key_layer_scaling and getattr(config, "softmax_type", "vanilla") == "vanilla")


def with_sdpa_attention(spec: Any, config: Any) -> Any:
    """A copy of a decoder block spec whose causal ``DotProductAttention`` layers use
    :class:`SdpaAttention`, when the attention is plain (:func:`plain_attention`); else ``spec``."""
    if not plain_attention(config):
        return spec
    _check_causal(spec)
    return replace_core_attention(spec, DotProductAttention, SdpaAttention)


def _check_causal(spec: Any) -> None:
    """Every self-attention of the spec masks causally (what ``is_causal`` assumes)."""
    layers = getattr(spec, "layer_specs", None) or [spec]
    for layer in layers:
        attention = layer.submodules.self_attention
        mask_type = attention.params.get("attn_mask_type", AttnMaskType.causal)
        if mask_type != AttnMaskType.causal:
            raise ValueError(f"SdpaAttention computes causal attention; a layer asks for {mask_type}")
