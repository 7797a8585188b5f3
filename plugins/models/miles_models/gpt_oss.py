"""gpt-oss family: ``gpt_oss``.

Quirks: a learned sink logit per query head in every attention softmax
(``self_attn.sinks``), alternating sliding-window and full layers
(``layer_types``, ``sliding_window``), q/k/v/o biases, yarn rope; every layer
MoE: the router linear has a bias, top-k over its logits with a softmax over
the chosen ones, experts with biases and the clamped SwiGLU
``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``.
Checkpoints store the experts fused: ``gate_up_proj [E, H, 2I]`` with gate and
up columns interleaved (and its bias ``[E, 2I]`` likewise), ``down_proj [E, I, H]``.
"""

from __future__ import annotations

from typing import Any, Mapping

from miles_host.models.config import ModelConfig, MoEConfig

from miles_models._config import base_fields, build, layer_types, rope_config
from miles_models._checks import refuse_true_on_policy
from miles_models._family import model_family
from miles_models._transforms import Transform, TransformWeightMap, deinterleave, interleave, swap_last_two
from miles_models._weights import L, Rule, common_rules, gqa_rules, norm_rules

always_active = True


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Native config of a gpt-oss model."""
    fields = base_fields(hf)
    num_layers = fields["num_layers"]
    if not hf.get("layer_types"):
        hf = {**hf, "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]}
    fields["layer_types"], fields["sliding_window"] = layer_types(hf, num_layers)
    fields["rope"] = rope_config(hf, fields["head_dim"], default_theta=150000.0)
    fields["qkv_bias"] = fields["o_bias"] = bool(hf.get("attention_bias", True))
    fields["attn_sinks"] = True
    moe = MoEConfig(
        num_experts=hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"],
        intermediate_size=hf["intermediate_size"],
        score_func="softmax",
        norm_topk_prob=True,
        router_bias=True,
        expert_biases=True,
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
    )
    return build(fields, moe)


def _gate_up_to_native(t):
    return deinterleave(swap_last_two(t), dim=1)


def _gate_up_to_hf(t):
    return swap_last_two(interleave(t, dim=1))


EXPERTS = "layers.{i}.mlp.experts"
WEIGHTS = TransformWeightMap(
    common_rules()
    + norm_rules("llama")
    + gqa_rules()
    + [
        Rule("layers.{i}.attn.sinks", (f"{L}self_attn.sinks",)),
        Rule("layers.{i}.mlp.router.weight", (f"{L}mlp.router.weight",)),
        Rule("layers.{i}.mlp.router.bias", (f"{L}mlp.router.bias",)),
        Rule(f"{EXPERTS}.down_proj_bias", (f"{L}mlp.experts.down_proj_bias",)),
    ],
    [
        Transform(f"{EXPERTS}.gate_up_proj", f"{L}mlp.experts.gate_up_proj", _gate_up_to_native, _gate_up_to_hf),
        Transform(
            f"{EXPERTS}.gate_up_proj_bias", f"{L}mlp.experts.gate_up_proj_bias",
            lambda t: deinterleave(t, dim=1), lambda t: interleave(t, dim=1),
        ),
        Transform(f"{EXPERTS}.down_proj", f"{L}mlp.experts.down_proj", swap_last_two, swap_last_two),
    ],
)


def miles_register_model_families():
    """The gpt-oss family record."""
    return [
        model_family(
            "gpt_oss", ("gpt_oss",), config_from_hf, WEIGHTS,
            description="gpt-oss (attention sinks, alternating sliding windows, biased MoE with clamped SwiGLU)",
            chat_defaults={"eos_tokens": ["<|return|>", "<|call|>", "<|endoftext|>"]},
        )
    ]


def miles_validate(config, registries):
    """``--true-on-policy`` is refused (with the reason) when the model has sinks or chunked attention."""
    refuse_true_on_policy(config, [t for record in miles_register_model_families() for t in record.model_types])
