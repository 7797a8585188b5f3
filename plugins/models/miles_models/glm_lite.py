"""GLM-4.7-Flash family: ``glm4_moe_lite``.

transformers builds it from DeepSeek-V3's multi-head latent attention (q/kv
LoRA, interleaved rotary by default, ``rope_interleave``) and GLM-4.5's MoE,
which routes as DeepSeek-V3 does (sigmoid scores, ``e_score_correction_bias``,
group-limited top-k, shared experts, fp32 router). What differs from the
``deepseek`` adapter: dense or MoE per layer from ``mlp_layer_types`` (default:
the first layer dense), ``routed_scaling_factor`` 1.8 and one group by default.
Weight names are DeepSeek-V3's (MTP layers after the decoder layers included).
"""

from __future__ import annotations

from typing import Any, Mapping

from miles_host.models.config import ModelConfig

from miles_models import deepseek
from miles_models._family import model_family

always_active = True


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Native config of a GLM-4.7-Flash model."""
    num_layers = hf["num_hidden_layers"]
    types = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (num_layers - 1)
    defaults = {"routed_scaling_factor": 1.8, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0}
    config = deepseek.config_from_hf({**defaults, **hf})
    config.hf_config = dict(hf)  # save back the checkpoint's own fields, not the defaults above
    config.moe_layers = [t == "sparse" for t in types][:num_layers]
    if len(config.moe_layers) != num_layers:
        raise ValueError(f"glm4_moe_lite: mlp_layer_types has {len(types)} entries for {num_layers} layers")
    return config


def miles_register_model_families():
    """The GLM-4.7-Flash family record."""
    return [
        model_family(
            "glm4_moe_lite", ("glm4_moe_lite",), config_from_hf, deepseek.WEIGHTS,
            description="GLM-4.7-Flash (MLA + DeepSeek-style MoE)",
            chat_defaults={"eos_tokens": ["<|endoftext|>", "<|user|>", "<|observation|>"]},
        )
    ]
