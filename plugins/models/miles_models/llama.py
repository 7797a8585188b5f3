"""Llama family: ``llama`` (Llama 2/3/3.1/3.2; llama3 rope scaling, optional biases)."""

from __future__ import annotations

from typing import Any, Mapping

from miles_host.models.config import ModelConfig

from miles_models._config import base_fields, build, rope_config
from miles_models._family import model_family
from miles_models._weights import WeightMap, common_rules, gqa_rules, mlp_rules, norm_rules

always_active = True


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Native config of a Llama model: ``attention_bias`` covers q/k/v/o, ``mlp_bias`` the MLP."""
    fields = base_fields(hf)
    fields["rope"] = rope_config(hf, fields["head_dim"])
    fields["qkv_bias"] = fields["o_bias"] = bool(hf.get("attention_bias", False))
    fields["mlp_bias"] = bool(hf.get("mlp_bias", False))
    return build(fields)


WEIGHTS = WeightMap(common_rules() + norm_rules("llama") + gqa_rules() + mlp_rules())


def miles_register_model_families():
    """The Llama family record."""
    return [
        model_family(
            "llama",
            ("llama",),
            config_from_hf,
            WEIGHTS,
            description="Llama 2/3.x",
            chat_defaults={"eos_tokens": ["<|eot_id|>", "<|end_of_text|>"]},
        )
    ]
