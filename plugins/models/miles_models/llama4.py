"""Llama-4 family, text only: ``llama4_text`` (``Llama4ForCausalLM``) and the language model
of ``llama4`` (``Llama4ForConditionalGeneration``: its ``text_config`` and ``language_model.*``
weights; the vision tower and projector are skipped when loading and not written when saving).

Quirks: chunked local attention (``attention_chunk_size``) on the rotary layers
and global NoPE layers (``no_rope_layers[i] == 0``) whose queries are
temperature-tuned by position (``attn_temperature_tuning``, ``floor_scale``,
``attn_scale``); interleaved rotary (complex pairs); a weightless L2 q/k norm
after the rotary on rotary layers (``use_qk_norm``); MoE layers
(``moe_layers`` / ``interleave_moe_layer_step``) with top-k sigmoid routing whose
weights scale each expert's input, plus one shared expert; dense layers use
``intermediate_size_mlp``. Checkpoints store the experts fused:
``feed_forward.experts.gate_up_proj [E, H, 2I]`` (gate columns first) and
``down_proj [E, I, H]``.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from miles_host.models.attention_variants import PositionsOnly
from miles_host.models.config import ModelConfig, MoEConfig

from miles_models._config import base_fields, build, rope_config
from miles_models._family import model_family
from miles_models._transforms import Transform, TransformWeightMap, swap_last_two
from miles_models._weights import L, Rule, common_rules, gqa_rules, mlp_rules, norm_rules

always_active = True


MULTIMODAL = "llama4"


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Native config of a Llama-4 text model (with transformers' defaults for absent keys);
    a multimodal config is read through its ``text_config`` and saved back whole."""
    original = dict(hf)
    if hf["model_type"] == MULTIMODAL:
        if not isinstance(hf.get("text_config"), Mapping):
            raise ValueError("config.json of model_type 'llama4' has no text_config (the language model's config)")
        hf = {**hf["text_config"], "model_type": MULTIMODAL}
    fields = base_fields(hf)
    fields["hf_config"] = original
    num_layers = fields["num_layers"]
    interval = hf.get("no_rope_layer_interval", 4)
    rope_layers = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
    chunk = hf.get("attention_chunk_size", 8192)
    types = hf.get("layer_types") or [
        "chunked_attention" if uses_rope and chunk is not None else "full_attention" for uses_rope in rope_layers
    ]
    fields["layer_types"] = list(types)[:num_layers]
    fields["attention_chunk_size"] = chunk if "chunked_attention" in fields["layer_types"] else None
    fields["nope_layers"] = [not bool(r) for r in rope_layers][:num_layers]
    fields["rope"] = rope_config(hf, fields["head_dim"], default_theta=500000.0, interleaved=True)
    if any(fields["nope_layers"]):
        fields["nope_rope"] = PositionsOnly(rotary_dim=2)
    if hf.get("attn_temperature_tuning", True):
        fields["attn_temperature"] = (float(hf.get("floor_scale", 8192)), float(hf.get("attn_scale", 0.1)))
    fields["qk_norm"] = "l2" if hf.get("use_qk_norm", True) else None
    fields["qkv_bias"] = fields["o_bias"] = bool(hf.get("attention_bias", False))
    fields["intermediate_size"] = hf.get("intermediate_size_mlp", 16384)
    moe_layers = hf.get("moe_layers")
    if moe_layers is None:
        step = hf.get("interleave_moe_layer_step", 1)
        moe_layers = list(range(step - 1, num_layers, step))
    fields["moe_layers"] = [i in set(moe_layers) for i in range(num_layers)]
    moe = MoEConfig(
        num_experts=hf.get("num_local_experts", 16),
        top_k=hf.get("num_experts_per_tok", 1),
        intermediate_size=hf.get("intermediate_size", 8192),
        score_func="sigmoid",
        norm_topk_prob=False,
        shared_intermediate_size=hf.get("intermediate_size", 8192),
        scale_expert_inputs=True,
    )
    return build(fields, moe)


class Llama4WeightMap(TransformWeightMap):
    """The text model's names; for a multimodal checkpoint under ``language_model.``, with the
    vision tower and projector skipped."""

    _LANGUAGE = re.compile(r"language_model\.(.+)")
    _VISION = ("vision_model.", "multi_modal_projector.")

    def convert_hf_tensor(self, name, tensor, config):
        if config.model_type == MULTIMODAL:
            if name.startswith(self._VISION):
                return []
            match = self._LANGUAGE.fullmatch(name)
            if match is None:
                return None
            name = match.group(1)
        return super().convert_hf_tensor(name, tensor, config)

    def convert_native_tensor(self, name, tensor, config):
        pairs = super().convert_native_tensor(name, tensor, config)
        if config.model_type == MULTIMODAL:
            return [(f"language_model.{hf}", t) for hf, t in pairs]
        return pairs


FF = "feed_forward"
WEIGHTS = Llama4WeightMap(
    common_rules()
    + norm_rules("llama")
    + gqa_rules()
    + mlp_rules(prefix=FF)
    + mlp_rules(prefix=f"{FF}.shared_expert", native="layers.{i}.mlp.shared_experts")
    + [Rule("layers.{i}.mlp.router.weight", (f"{L}{FF}.router.weight",))],
    [
        Transform("layers.{i}.mlp.experts.gate_up_proj", f"{L}{FF}.experts.gate_up_proj", swap_last_two, swap_last_two),
        Transform("layers.{i}.mlp.experts.down_proj", f"{L}{FF}.experts.down_proj", swap_last_two, swap_last_two),
    ],
)


def miles_register_model_families():
    """The Llama-4 (text) family record."""
    return [
        model_family(
            "llama4", ("llama4_text", MULTIMODAL), config_from_hf, WEIGHTS,
            description="Llama 4 text (chunked local + NoPE global attention, MoE with a shared expert)",
            chat_defaults={"eos_tokens": ["<|eot|>", "<|end_of_text|>"]},
        )
    ]
