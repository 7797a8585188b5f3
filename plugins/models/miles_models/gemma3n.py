"""Gemma-3n text (``gemma3n_text``, and the language model of the multimodal ``gemma3n``,
whose vision and audio towers are not loaded): :mod:`miles_host.models.gemma3n`'s decoder.

Quirks: AltUp streams (``altup_*``), per-layer embeddings (``embed_tokens_per_layer``,
``per_layer_model_projection``), LAuReL (``laurel_rank``), per-layer MLP widths
(``intermediate_size`` may be a list) with Gaussian top-k activation sparsity
(``activation_sparsity_pattern``), the last ``num_kv_shared_layers`` layers reusing the keys
and values of the last earlier layer of their type (published checkpoints still store k/v
projections for them; they are ignored), q/k/v norms with attention scale 1, sliding and
full layers with their own rope, final-logit soft-capping, tied embeddings.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from miles_host.models.config import Gemma3nConfig, ModelConfig

from miles_models._config import base_fields, build, layer_types, rope_config
from miles_models._family import model_family
from miles_models._weights import L, Rule, WeightMap, common_rules, mlp_rules, norm_rules

always_active = True


def _per_layer(value: Any, key: str, num_layers: int) -> list:
    """A per-layer list from a list or one value for every layer."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * num_layers
    if len(values) != num_layers:
        raise ValueError(f"gemma3n_text: {key} has {len(values)} entries for {num_layers} layers")
    return values


def kv_sources(types: list[str], num_shared: int) -> list[int | None]:
    """For each layer, the earlier layer whose K/V it reuses: the last layer of its type before
    the last ``num_shared`` layers (transformers' ``kv_sharing_modes``)."""
    first_shared = len(types) - num_shared
    sources: list[int | None] = [None] * len(types)
    for i in range(max(first_shared, 0), len(types)):
        producers = [j for j in range(first_shared) if types[j] == types[i]]
        if not producers:
            raise ValueError(
                f"gemma3n_text: layer {i} ({types[i]}) shares K/V but no earlier {types[i]} layer produces them; "
                "lower num_kv_shared_layers"
            )
        sources[i] = producers[-1]
    return sources


#: the multimodal type: its ``text_config`` and ``model.language_model.*`` weights are read, the towers skipped
MULTIMODAL = "gemma3n"
TOWERS = r"model\.(vision_tower|audio_tower|embed_vision|embed_audio)\..*"


def text_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config: ``text_config`` of the multimodal config, else the config itself."""
    if hf["model_type"] == MULTIMODAL:
        if not isinstance(hf.get("text_config"), Mapping):
            raise ValueError("gemma3n: config.json has no text_config (the language model's config)")
        return {**hf["text_config"], "model_type": MULTIMODAL}
    return dict(hf)


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Native config of a Gemma-3n text model (of the multimodal model's language model)."""
    original, hf = hf, text_config(hf)
    fields = base_fields(hf, tie_default=True)
    fields["hf_config"] = dict(original)
    num_layers = fields["num_layers"]
    if "hidden_activation" not in hf and "hidden_act" not in hf:
        fields["hidden_act"] = "gelu_tanh"
    widths = [int(w) for w in _per_layer(hf.get("intermediate_size", 16384), "intermediate_size", num_layers)]
    fields["intermediate_size"] = max(widths)
    if not hf.get("layer_types"):
        default = ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(num_layers)]
        hf = {**hf, "layer_types": default}
    fields["layer_types"], fields["sliding_window"] = layer_types(hf, num_layers)
    fields["qk_norm"] = "head"
    fields["attn_scale"] = 1.0
    fields["embed_scale"] = hf["hidden_size"] ** 0.5
    fields["qkv_bias"] = fields["o_bias"] = bool(hf.get("attention_bias", False))
    fields["final_logit_softcap"] = hf.get("final_logit_softcapping", 30.0)
    fields["rope"] = rope_config(hf, fields["head_dim"], default_theta=1e6, layer_type="full_attention")
    fields["local_rope"] = rope_config(
        hf, fields["head_dim"], default_theta=hf.get("rope_local_base_freq", 10000.0), layer_type="sliding_attention"
    )
    sparsity = hf.get("activation_sparsity_pattern")
    if sparsity is None:
        dense_from = 10 if num_layers > 10 else 0
        sparsity = [0.95] * dense_from + [0.0] * (num_layers - dense_from)
    fields["gemma3n"] = Gemma3nConfig(
        hidden_size_per_layer_input=int(hf.get("hidden_size_per_layer_input", 256)),
        vocab_size_per_layer_input=int(hf.get("vocab_size_per_layer_input", 262_144)),
        altup_num_inputs=int(hf.get("altup_num_inputs", 4)),
        altup_active_idx=int(hf.get("altup_active_idx", 0)),
        altup_coef_clip=hf.get("altup_coef_clip", 120.0),
        altup_correct_scale=bool(hf.get("altup_correct_scale", True)),
        laurel_rank=int(hf.get("laurel_rank", 64)),
        intermediate_sizes=widths,
        activation_sparsity=[float(s) for s in _per_layer(sparsity, "activation_sparsity_pattern", num_layers)],
        kv_source=kv_sources(fields["layer_types"], int(hf.get("num_kv_shared_layers", 15) or 0)),
    )
    return build(fields)


class Gemma3nWeightMap(WeightMap):
    """Reads the multimodal checkpoint's language model (``model.language_model.*``, towers
    skipped; written back under that prefix) and ignores the k/v projections and norms
    published for KV-sharing layers (they are unused)."""

    _LANGUAGE = re.compile(r"model\.language_model\.(.+)")
    _SHARED_KV = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.\w+")

    def __init__(self, rules):
        super().__init__(rules, ignore=(r".*rotary_emb\.inv_freq", TOWERS))

    def _text_name(self, name: str) -> str:
        match = self._LANGUAGE.fullmatch(name)
        return f"model.{match.group(1)}" if match else name

    def hf_to_native(self, name):
        return super().hf_to_native(self._text_name(name))

    def convert_hf_tensor(self, name, tensor, config):
        name = self._text_name(name)
        match = self._SHARED_KV.fullmatch(name)
        if match and config.gemma3n.kv_source[int(match.group(1))] is not None:
            return []
        return super().convert_hf_tensor(name, tensor, config)

    def convert_native_tensor(self, name, tensor, config):
        pairs = super().convert_native_tensor(name, tensor, config)
        if config.model_type != MULTIMODAL:
            return pairs
        return [(re.sub(r"^model\.", "model.language_model.", hf), t) for hf, t in pairs]


def _same(names: tuple[str, ...], native: str, hf: str) -> list[Rule]:
    return [Rule(native + n, (hf + n,)) for n in names]


_LAYER_EXTRAS = (
    "altup.correct_output_scale", "altup.correction_coefs.weight", "altup.prediction_coefs.weight",
    "altup.modality_router.weight", "altup.router_norm.weight", "laurel.linear_left.weight",
    "laurel.linear_right.weight", "laurel.post_laurel_norm.weight", "per_layer_input_gate.weight",
    "per_layer_projection.weight", "post_per_layer_input_norm.weight",
)
_MODEL_EXTRAS = (
    "embed_tokens_per_layer.weight", "per_layer_model_projection.weight", "per_layer_projection_norm.weight",
)
_ATTENTION = (
    *(f"{p}_proj.{kind}" for p in "qkvo" for kind in ("weight", "bias")), "q_norm.weight", "k_norm.weight",
)

WEIGHTS = Gemma3nWeightMap(
    common_rules()
    + norm_rules("gemma")
    + mlp_rules()
    + _same(_ATTENTION, "layers.{i}.attn.", f"{L}self_attn.")
    + _same(_LAYER_EXTRAS, "layers.{i}.", L)
    + _same(_MODEL_EXTRAS, "", "model.")
    + [
        Rule(f"{name}.{{i}}.weight", (f"model.{name}.{{i}}.weight",))
        for name in ("altup_projections", "altup_unembed_projections")
    ]
)


def miles_register_model_families():
    """The Gemma-3n (text) family record."""
    return [
        model_family(
            "gemma3n", ("gemma3n_text", MULTIMODAL), config_from_hf, WEIGHTS,
            description="Gemma 3n (text: AltUp, per-layer embeddings, LAuReL, KV sharing, activation sparsity)",
            chat_defaults={"eos_tokens": ["<end_of_turn>", "<eos>"]},
        )
    ]
