"""Gemma family: ``gemma2`` and ``gemma3_text``.

Quirks: RMSNorm weights stored as offsets from 1 (``(1 + w)``), embeddings
scaled by ``sqrt(hidden_size)``, GeGLU (tanh GELU), sandwich norms
(``post_attention_layernorm`` after attention, ``pre/post_feedforward_layernorm``
around the MLP), attention scale ``query_pre_attn_scalar ** -0.5``, alternating
sliding-window layers (``layer_types``), tied embeddings by default. gemma2:
attention-logit and final-logit soft-capping. gemma3: per-head q/k norm and a
separate rope (``rope_local_base_freq``) for sliding layers.
"""

from __future__ import annotations

from typing import Any, Mapping

from miles_host.models.config import ModelConfig

from miles_models._config import base_fields, build, layer_types, rope_config
from miles_models._family import model_family
from miles_models._weights import WeightMap, common_rules, gqa_rules, mlp_rules, norm_rules

always_active = True


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Native config of a Gemma-2 or Gemma-3 (text) model."""
    model_type = hf["model_type"]
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{model_type}: use_bidirectional_attention=True is not supported (causal LMs only)")
    fields = base_fields(hf, tie_default=True)
    if "hidden_activation" not in hf and "hidden_act" not in hf:
        fields["hidden_act"] = "gelu_tanh"
    fields["norm_unit_offset"] = True
    fields["sandwich_norm"] = True
    fields["embed_scale"] = hf["hidden_size"] ** 0.5
    fields["attn_scale"] = float(hf.get("query_pre_attn_scalar", 256)) ** -0.5
    fields["qkv_bias"] = fields["o_bias"] = bool(hf.get("attention_bias", False))
    num_layers = fields["num_layers"]
    if "layer_types" not in hf:
        pattern = 2 if model_type == "gemma2" else hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        hf = {**hf, "layer_types": ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]}
    fields["layer_types"], fields["sliding_window"] = layer_types(hf, num_layers)
    if model_type == "gemma2":
        fields["rope"] = rope_config(hf, fields["head_dim"])
        fields["attn_logit_softcap"] = hf.get("attn_logit_softcapping", 50.0)
        fields["final_logit_softcap"] = hf.get("final_logit_softcapping", 30.0)
    else:
        fields["qk_norm"] = "head"
        fields["rope"] = rope_config(hf, fields["head_dim"], default_theta=1e6, layer_type="full_attention")
        local = {**hf, "rope_scaling": None, "rope_theta": hf.get("rope_local_base_freq", 10000.0)}
        fields["local_rope"] = rope_config(local, fields["head_dim"], layer_type="sliding_attention")
        fields["final_logit_softcap"] = hf.get("final_logit_softcapping")
        # transformers' Gemma-3 attention never applies attn_logit_softcapping
    return build(fields)


WEIGHTS = WeightMap(common_rules() + norm_rules("gemma") + gqa_rules() + mlp_rules())


def miles_register_model_families():
    """The Gemma family record."""
    return [
        model_family(
            "gemma", ("gemma2", "gemma3_text"), config_from_hf, WEIGHTS,
            description="Gemma 2 / Gemma 3 (text)", chat_defaults={"eos_tokens": ["<end_of_turn>", "<eos>"]},
        )
    ]
