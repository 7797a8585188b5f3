"""gpt-oss family: ``gpt_oss``.

Quirks: a learned sink logit per query head in every attention softmax
(``self_attn.sinks``), alternating sliding-window and full layers
(``layer_types``, ``sliding_window``), q/k/v/o biases, yarn rope; every layer
MoE: the router linear has a bias, top-k over its logits with a softmax over
the chosen ones, experts with biases and the clamped SwiGLU
``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``.
Checkpoints store the experts fused: ``gate_up_proj [E, H, 2I]`` with gate and
up columns interleaved (and its bias ``[E, 2I]`` likewise), ``down_proj [E, I, H]``;
OpenAI's own checkpoints store them in MXFP4 (``{proj}_blocks`` / ``{proj}_scales``,
rows = output features), dequantized on load (:mod:`miles_models._mxfp4`) and saved
unquantized (the config's MXFP4 ``quantization_config`` dropped).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

from miles_host.models.config import ModelConfig, MoEConfig

from miles_models._config import base_fields, build, hf_config_from_native, layer_types, rope_config
from miles_models._family import model_family
from miles_models._mxfp4 import PairedParts, dequantize_mxfp4
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


class GptOssWeightMap(TransformWeightMap):
    """The transform rules, plus MXFP4 experts (load only): both parts of a projection
    become its dequantized native tensor once the second part arrives."""

    _MXFP4 = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales)")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._parts = PairedParts()

    def hf_to_native(self, name: str) -> str | None:
        match = self._MXFP4.fullmatch(name)
        if match:
            return f"layers.{match.group(1)}.mlp.experts.{match.group(2)}"
        return super().hf_to_native(name)

    def convert_hf_tensor(self, name, tensor, config):
        match = self._MXFP4.fullmatch(name)
        if match is None:
            return super().convert_hf_tensor(name, tensor, config)
        layer, proj, part = match.groups()
        parts = self._parts.add((layer, proj), part, tensor)
        if parts is None:
            return []
        weight = dequantize_mxfp4(parts["blocks"], parts["scales"])  # [E, out, in]
        if proj == "gate_up_proj":  # rows: gate and up interleaved
            weight = deinterleave(weight, dim=1)
        return [(f"layers.{layer}.mlp.experts.{proj}", weight, None)]


def _hf_config(config: ModelConfig, original: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The HF config to save: MXFP4 experts are saved dequantized, so without their quantization_config."""
    hf = hf_config_from_native(config, original)
    if (hf.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        hf.pop("quantization_config")
    return hf


EXPERTS = "layers.{i}.mlp.experts"
WEIGHTS = GptOssWeightMap(
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
    record = model_family(
        "gpt_oss", ("gpt_oss",), config_from_hf, WEIGHTS,
        description="gpt-oss (attention sinks, alternating sliding windows, biased MoE with clamped SwiGLU)",
        chat_defaults={"eos_tokens": ["<|return|>", "<|call|>", "<|endoftext|>"]},
    )
    return [dataclasses.replace(record, hf_config_from_native=_hf_config)]
