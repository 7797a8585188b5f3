"""GLM family: ``glm4`` (GLM-4 dense) and ``glm4_moe`` (GLM-4.5 / 4.6).

Quirks: partial rotary (``partial_rotary_factor``, 0.5 by default); glm4 rotates
interleaved pairs, has sandwich norms (``post_self_attn_layernorm``,
``post_mlp_layernorm``), a fused ``gate_up_proj`` in HF and q/k/v bias;
glm4_moe rotates halves, has optional per-head q/k norm (``use_qk_norm``),
DeepSeek-style sigmoid routing with expert bias and shared experts, and MTP
layers after the decoder layers.
"""

from __future__ import annotations

from typing import Any, Mapping

from miles_host.models.config import ModelConfig

from miles_models._config import base_fields, build, rope_config, sigmoid_group_moe
from miles_models._family import model_family
from miles_models._weights import MTPWeightMap, WeightMap, common_rules, gqa_rules, mlp_rules, moe_rules, norm_rules

always_active = True


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Native config of a GLM-4 or GLM-4.5 model."""
    model_type = hf["model_type"]
    fields = base_fields(hf)
    dense = model_type == "glm4"
    fields["rope"] = rope_config(hf, fields["head_dim"], default_partial=0.5, interleaved=dense)
    fields["qkv_bias"] = bool(hf.get("attention_bias", dense))
    if dense:
        fields["sandwich_norm"] = True
        return build(fields)
    if hf.get("use_qk_norm", False):
        fields["qk_norm"] = "head"
    moe = sigmoid_group_moe(hf, fields, first_k_dense_default=1, scaling_default=1.0)
    return build(fields, moe)


GLM4_WEIGHTS = WeightMap(common_rules() + norm_rules("glm4") + gqa_rules() + mlp_rules(hf_fused=True))
GLM4_MOE_WEIGHTS = MTPWeightMap(
    common_rules()
    + norm_rules("llama")
    + gqa_rules()
    + mlp_rules()
    + moe_rules(shared="shared_experts", expert_bias="gate.e_score_correction_bias")
)


def miles_register_model_families():
    """Two records: the layouts of GLM-4 and GLM-4.5 differ."""
    chat = {"eos_tokens": ["<|endoftext|>", "<|user|>", "<|observation|>"]}
    return [
        model_family("glm4", ("glm4",), config_from_hf, GLM4_WEIGHTS, description="GLM-4 dense", chat_defaults=chat),
        model_family(
            "glm4_moe", ("glm4_moe",), config_from_hf, GLM4_MOE_WEIGHTS,
            description="GLM-4.5/4.6 MoE", chat_defaults=chat,
        ),
    ]
