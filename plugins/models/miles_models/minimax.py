"""MiniMax family: ``minimax_m2``.

Quirks: q/k RMSNorm over all heads at once (``[N * D]``), partial rotary
(``rotary_dim``), every layer MoE with sigmoid scores + ``e_score_correction_bias``
(stored on the block, not the router) and always-normalised top-k weights, HF
names ``block_sparse_moe.experts.{e}.w1/w3/w2``.
"""

from __future__ import annotations

from typing import Any, Mapping

from miles_host.models.config import ModelConfig, MoEConfig

from miles_models._config import base_fields, build, rope_config
from miles_models._family import model_family
from miles_models._weights import WeightMap, common_rules, gqa_rules, moe_rules, norm_rules

always_active = True


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Native config of a MiniMax-M2 model."""
    fields = base_fields(hf)
    rotary_dim = hf.get("rotary_dim")
    fields["rope"] = rope_config(hf, fields["head_dim"], default_theta=5e6, rotary_dim=rotary_dim)
    fields["qk_norm"] = "full"
    moe = MoEConfig(
        num_experts=hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"],
        intermediate_size=hf["intermediate_size"],
        score_func="sigmoid",
        norm_topk_prob=True,
        expert_bias=True,
    )
    return build(fields, moe)


WEIGHTS = WeightMap(
    common_rules()
    + norm_rules("llama")
    + gqa_rules()
    + moe_rules(
        prefix="block_sparse_moe",
        expert_names=("w1.weight", "w3.weight", "w2.weight"),
        expert_bias="e_score_correction_bias",
    )
)


def miles_register_model_families():
    """The MiniMax family record."""
    return [
        model_family(
            "minimax", ("minimax_m2",), config_from_hf, WEIGHTS,
            description="MiniMax-M2", chat_defaults={"eos_tokens": ["[e~["]},
        )
    ]
