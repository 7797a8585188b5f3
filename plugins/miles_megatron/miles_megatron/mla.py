"""DeepSeek multi-head latent attention (MLA) and its rope on Megatron-Core's own MLA.

A native config with :class:`~miles_host.models.config.MLAConfig` is built as an
``MLATransformerConfig`` (``multi_latent_attention=True``), so the local layer spec
builds ``MLASelfAttention``: ``linear_q_down_proj -> q_layernorm -> linear_q_up_proj``
(or ``linear_q_proj`` when ``q_lora_rank`` is None), ``linear_kv_down_proj`` (latent +
the shared rotary key) ``-> kv_layernorm -> linear_kv_up_proj``, ``linear_proj``.
``qk_layernorm=True`` is what makes that spec build the two latent norms.

What Megatron computes and what transformers' DeepSeek-V3 computes, and why they agree:

- rotary layout: Megatron's MLA always de-interleaves the rotary dims (evens, then odds)
  before ``rotate_half``, which is transformers' ``apply_rotary_pos_emb_interleave``
  (``rope_interleave=True``, DeepSeek's default); ``rope_interleave=False`` is refused;
- the rope is computed inside the attention from each token's index in its padded
  sequence (no ``rotary_pos_emb`` is passed to an MLA decoder): the trainer packs
  positions ``0 .. len-1`` per sequence, which are those indices;
- rope types (:data:`ROPE_TYPES`): ``default`` as Megatron's ``rope``, ``yarn`` as its
  ``yarn`` with the scaling factor, original context, ``beta_fast``/``beta_slow`` and
  ``mscale``/``mscale_all_dim``. The cos/sin factor (HF's ``attention_factor``) must be
  the one Megatron derives from those (:func:`mla_problems` compares them), and the
  softmax scale ``mscale(factor, mscale_all_dim)**2 / sqrt(qk_head_dim)`` is HF's;
- key/value heads: Megatron's local attention writes ``v_head_dim`` per head into a
  ``kv_channels * heads`` output, so ``kv_channels`` is ``v_head_dim``;
- the latent norms use RMSNorm's default epsilon in HF (``DeepseekV3RMSNorm(rank)``), not
  ``rms_norm_eps``: :func:`set_latent_norm_eps` sets it on Megatron's modules.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

#: ``eps`` of DeepSeek's ``q_a_layernorm`` / ``kv_a_layernorm`` (HF builds them without ``rms_norm_eps``)
LATENT_NORM_EPS = 1e-6


def _default_rope(rope: Any) -> dict[str, Any]:
    return {"rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}


def _yarn_rope(rope: Any) -> dict[str, Any]:
    return {
        "rope_type": "yarn",
        "rotary_scaling_factor": float(rope.factor),
        "original_max_position_embeddings": int(rope.original_max_position_embeddings),
        "beta_fast": float(rope.beta_fast),
        "beta_slow": float(rope.beta_slow),
        # HF reads a missing or zero mscale as 1 (its plain yarn factor) and a missing mscale_all_dim as 0
        "mscale": float(rope.mscale) if rope.mscale else 1.0,
        "mscale_all_dim": float(rope.mscale_all_dim or 0.0),
    }


#: native ``rope_type`` -> ``MLATransformerConfig`` rope settings of Megatron's MLA
ROPE_TYPES: dict[str, Callable[[Any], dict[str, Any]]] = {"default": _default_rope, "yarn": _yarn_rope}


def _megatron_attention_factor(rope_kwargs: dict[str, Any]) -> float:
    """The cos/sin factor Megatron's ``YarnRotaryEmbedding`` applies (1 for plain rope)."""
    if rope_kwargs["rope_type"] != "yarn":
        return 1.0

    def mscale(scale: float, value: float) -> float:
        return 1.0 if scale <= 1 else 0.1 * value * math.log(scale) + 1.0

    factor = rope_kwargs["rotary_scaling_factor"]
    return mscale(factor, rope_kwargs["mscale"]) / mscale(factor, rope_kwargs["mscale_all_dim"])


def mla_problems(config: Any) -> list[str]:
    """What of an MLA model Megatron's MLA computes differently (empty: it builds the model)."""
    from miles_host.models.rope import inverse_frequencies

    mla, rope = config.mla, config.rope
    problems = []
    if rope.rope_type not in ROPE_TYPES:
        problems.append(f"MLA with rope scaling {rope.rope_type!r} (Megatron's MLA has rope and yarn)")
        return problems
    if not rope.interleaved:
        problems.append("MLA with rope_interleave=false (Megatron's MLA rotates interleaved pairs)")
    if rope.rotary_dim != mla.qk_rope_head_dim:
        problems.append("MLA rotating part of qk_rope_head_dim")
    if rope.rope_type == "yarn" and not rope.truncate:
        problems.append("yarn with truncate=false (Megatron rounds the correction range)")
    if config.qkv_bias or config.o_bias:
        problems.append("MLA projection biases (attention_bias)")
    if config.local_rope is not None:
        problems.append("a second rope for sliding layers")
    wanted = inverse_frequencies(rope)[1]
    got = _megatron_attention_factor(ROPE_TYPES[rope.rope_type](rope))
    if not math.isclose(wanted, got, rel_tol=1e-6):
        problems.append(f"yarn attention factor {wanted:g} (Megatron's MLA derives {got:g} from factor/mscale/"
                        "mscale_all_dim)")
    return problems


def mla_config_kwargs(config: Any) -> dict[str, Any]:
    """``MLATransformerConfig`` arguments of an MLA model (check :func:`mla_problems` first)."""
    mla, rope = config.mla, config.rope
    return {
        "multi_latent_attention": True,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_head_dim": mla.qk_nope_head_dim,
        "qk_pos_emb_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "kv_channels": mla.v_head_dim,
        "num_query_groups": config.num_heads,
        "qk_layernorm": True,
        "rotary_base": float(rope.theta),
        **ROPE_TYPES[rope.rope_type](rope),
    }


def config_class(kwargs: dict[str, Any]) -> type:
    """``MLATransformerConfig`` for MLA arguments, else ``TransformerConfig``."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    return MLATransformerConfig if kwargs.get("multi_latent_attention") else TransformerConfig


def tensor_parallel_problems(config: Any, tp: int) -> list[str]:
    """MLA's down projections are column-parallel (split by rows, gathered after): their
    output sizes must divide over the TP ranks."""
    mla = config.mla
    if mla is None or tp == 1:
        return []
    sizes = {"kv_lora_rank + qk_rope_head_dim": mla.kv_lora_rank + mla.qk_rope_head_dim}
    if mla.q_lora_rank is not None:
        sizes["q_lora_rank"] = mla.q_lora_rank
    return [f"{name} ({size})" for name, size in sizes.items() if size % tp]


def set_latent_norm_eps(layer: torch.nn.Module) -> None:
    """DeepSeek's latent norms' epsilon on an MLA layer's ``q_layernorm`` / ``kv_layernorm``."""
    attention = layer.self_attention
    for name in ("q_layernorm", "kv_layernorm"):
        norm = getattr(attention, name, None)
        if norm is not None and hasattr(norm, "eps"):
            norm.eps = LATENT_NORM_EPS
