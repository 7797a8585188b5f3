"""DeepSeek family: ``deepseek_v3`` (also DeepSeek-R1 / V3.1 checkpoints).

Quirks: multi-head latent attention (with or without ``q_lora_rank``),
interleaved rotary (``rope_interleave``), yarn with an extra softmax scale
(``mscale_all_dim``), sigmoid routing with ``e_score_correction_bias`` and
group-limited top-k, ``routed_scaling_factor``, shared experts, the first
``first_k_dense_replace`` layers dense, and MTP layers stored as
``model.layers.{num_hidden_layers + j}``.
"""

from __future__ import annotations

from typing import Any, Mapping

from miles_host.models.config import MLAConfig, ModelConfig

from miles_models._config import base_fields, build, rope_config, sigmoid_group_moe
from miles_models._family import model_family
from miles_models._weights import MTPWeightMap, common_rules, mla_rules, mlp_rules, moe_rules, norm_rules

always_active = True


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Native config of a DeepSeek-V3 model."""
    fields = base_fields(hf)
    mla = MLAConfig(
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        q_lora_rank=hf.get("q_lora_rank"),
    )
    fields["head_dim"] = mla.qk_head_dim
    fields["mla"] = mla
    fields["rope"] = rope_config(
        hf, mla.qk_rope_head_dim, interleaved=bool(hf.get("rope_interleave", True)), rotary_dim=mla.qk_rope_head_dim
    )
    fields["qkv_bias"] = fields["o_bias"] = bool(hf.get("attention_bias", False))
    moe = sigmoid_group_moe(hf, fields, first_k_dense_default=3, scaling_default=2.5)
    return build(fields, moe)


WEIGHTS = MTPWeightMap(
    common_rules()
    + norm_rules("llama")
    + mla_rules()
    + mlp_rules()
    + moe_rules(shared="shared_experts", expert_bias="gate.e_score_correction_bias")
)


def miles_register_model_families():
    """The DeepSeek family record."""
    return [
        model_family(
            "deepseek",
            ("deepseek_v3",),
            config_from_hf,
            WEIGHTS,
            description="DeepSeek-V3 / R1 (MLA, sigmoid group-limited MoE, MTP)",
            chat_defaults={"eos_tokens": ["<｜end▁of▁sentence｜>"]},
        )
    ]
