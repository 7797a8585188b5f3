"""Qwen family: ``qwen2``, ``qwen2_moe``, ``qwen3``, ``qwen3_moe``.

Quirks: qwen2/qwen2_moe have q/k/v bias (no o bias); qwen3 has per-head q/k
RMSNorm and ``attention_bias`` on all four projections; MoE uses softmax scores
(``norm_topk_prob`` off by default); qwen2_moe adds one shared expert gated by
``sigmoid(shared_expert_gate(x))``; dense layers are chosen by
``mlp_only_layers`` / ``decoder_sparse_step``.
"""

from __future__ import annotations

from typing import Any, Mapping

from miles_host.models.config import ModelConfig, MoEConfig

from miles_models._config import base_fields, build, layer_types, moe_layer_flags, rope_config
from miles_models._family import model_family
from miles_models._weights import WeightMap, common_rules, gqa_rules, mlp_rules, moe_rules, norm_rules

always_active = True

QWEN_CHAT = {"chat_template_style": "chatml", "eos_tokens": ["<|im_end|>", "<|endoftext|>"]}


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Native config of any Qwen model type."""
    model_type = hf["model_type"]
    fields = base_fields(hf)
    fields["rope"] = rope_config(hf, fields["head_dim"])
    if model_type in ("qwen2", "qwen2_moe"):
        fields["qkv_bias"] = bool(hf.get("qkv_bias", True))
    else:
        fields["qkv_bias"] = fields["o_bias"] = bool(hf.get("attention_bias", False))
        fields["qk_norm"] = "head"
    if model_type == "qwen3_moe":
        window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
        types = ["sliding_attention" if window else "full_attention"] * fields["num_layers"]
    else:
        types, window = layer_types(hf, fields["num_layers"])
    fields["layer_types"], fields["sliding_window"] = types, window
    moe = None
    if model_type.endswith("_moe"):
        num_experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
        fields["moe_layers"] = moe_layer_flags(hf, fields["num_layers"], num_experts=num_experts)
        shared = hf.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
        moe = MoEConfig(
            num_experts=num_experts,
            top_k=hf["num_experts_per_tok"],
            intermediate_size=hf["moe_intermediate_size"],
            score_func="softmax",
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            shared_intermediate_size=shared,
            shared_expert_gate=bool(shared),
        )
    return build(fields, moe)


WEIGHTS = WeightMap(
    common_rules()
    + norm_rules("llama")
    + gqa_rules()
    + mlp_rules()
    + moe_rules(shared="shared_expert", shared_gate="shared_expert_gate")
)


def miles_register_model_families():
    """The Qwen family record."""
    return [
        model_family(
            "qwen",
            ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"),
            config_from_hf,
            WEIGHTS,
            description="Qwen2/Qwen2.5/Qwen3 dense and MoE",
            chat_defaults=QWEN_CHAT,
        )
    ]
