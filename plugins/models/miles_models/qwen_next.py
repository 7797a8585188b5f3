"""Qwen3-Next / Qwen3.5 family: ``qwen3_next``, ``qwen3_5`` / ``qwen3_5_text``, ``qwen3_5_moe`` / ``qwen3_5_moe_text``.

Quirks: ``layer_types`` interleave Gated DeltaNet ``linear_attention`` layers with gated
``full_attention`` (``q_proj`` emits a per-head output gate; zero-centred q/k norms; partial
rotary, 0.25 by default); every RMSNorm but the DeltaNet's gated one stores its weight as an
offset from 1. qwen3_next projects the DeltaNet inputs with ``in_proj_qkvz`` / ``in_proj_ba``
grouped per key head, Qwen3.5 with flat ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` /
``in_proj_a`` (both fuse into one native ``in_proj``). MoE: softmax top-k (always normalised
in Qwen3.5) plus one shared expert gated by ``sigmoid(shared_expert_gate(x))``; qwen3_next
chooses its MoE layers by ``decoder_sparse_step`` / ``mlp_only_layers``, Qwen3.5-MoE has MoE
everywhere. Experts are saved per expert (as transformers saves them) and load from either
layout.

The multimodal ``qwen3_5`` / ``qwen3_5_moe`` configs are read through their ``text_config``
and their language-model weights (``model.language_model.*``); the vision tower is not loaded.
The MTP layer (``mtp_num_hidden_layers: 1``, ``mtp.*``) loads into miles' MTP slot (the draft of
miles-spec and the MTP loss); speculative rollout itself is refused for these models by the
engine (a recurrent state cannot be rolled back to the accepted prefix).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from miles_host.models.config import ModelConfig, MoEConfig
from miles_host.models.gated_deltanet import GatedDeltaNetConfig, true_on_policy_refusal

from miles_models._checks import refuse_true_on_policy
from miles_models._config import base_fields, build, moe_layer_flags, rope_config
from miles_models._family import model_family
from miles_models._weights import L, Rule, WeightMap, common_rules, gqa_rules, mlp_rules, moe_rules, norm_rules
from miles_models.qwen import QWEN_CHAT

always_active = True

MULTIMODAL_TYPES = ("qwen3_5", "qwen3_5_moe")


def text_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config: ``text_config`` of a multimodal config, else the config itself."""
    if hf["model_type"] in MULTIMODAL_TYPES and isinstance(hf.get("text_config"), Mapping):
        return {**hf["text_config"], "model_type": hf["model_type"]}
    return dict(hf)


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Native config of a Qwen3-Next or Qwen3.5 (text) model."""
    original, hf = hf, text_config(hf)
    model_type = hf["model_type"]
    fields = base_fields(hf)
    fields["hf_config"] = dict(original)
    num_layers = fields["num_layers"]
    fields["rope"] = rope_config(hf, fields["head_dim"], default_partial=0.25)
    fields["norm_unit_offset"] = True
    fields["qk_norm"] = "head"
    fields["attn_output_gate"] = True
    fields["qkv_bias"] = fields["o_bias"] = bool(hf.get("attention_bias", False))
    # one MTP layer (the published checkpoints' count) maps onto miles' MTP slot; more are not loaded
    fields["num_mtp_layers"] = 1 if hf.get("mtp_num_hidden_layers", 0) == 1 else 0
    fields["mtp_shared_embeddings"] = not hf.get("mtp_use_dedicated_embeddings", False)
    interval = hf.get("full_attention_interval", 4)
    fields["layer_types"] = list(hf.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)
    ])[:num_layers]
    fields["linear_attention"] = GatedDeltaNetConfig(
        num_key_heads=hf.get("linear_num_key_heads", 16),
        num_value_heads=hf.get("linear_num_value_heads", 32),
        key_head_dim=hf.get("linear_key_head_dim", 128),
        value_head_dim=hf.get("linear_value_head_dim", 128),
        conv_kernel_size=hf.get("linear_conv_kernel_dim", 4),
        grouped_projection=model_type == "qwen3_next",
    )
    moe = None
    num_experts = hf.get("num_experts") or 0
    if model_type.startswith("qwen3_5_moe"):
        fields["moe_layers"] = [True] * num_layers
    elif model_type == "qwen3_next":
        fields["moe_layers"] = moe_layer_flags(
            {**hf, "mlp_only_layers": hf.get("mlp_only_layers") or []}, num_layers, num_experts=num_experts
        )
    if any(fields.get("moe_layers") or ()):
        shared = hf.get("shared_expert_intermediate_size", 0) or 0
        moe = MoEConfig(
            num_experts=num_experts,
            top_k=hf["num_experts_per_tok"],
            intermediate_size=hf["moe_intermediate_size"],
            score_func="softmax",
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)) or model_type.startswith("qwen3_5_moe"),
            shared_intermediate_size=shared,
            shared_expert_gate=bool(shared),
        )
    return build(fields, moe)


def _gated_qkv_sizes(config: Any) -> tuple[int, int, int]:
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    return 2 * q, kv, kv


def _grouped_in_proj_sizes(config: Any) -> tuple[int, int]:
    lin = config.linear_attention
    return lin.conv_dim + lin.value_dim, 2 * lin.num_value_heads


def _flat_in_proj_sizes(config: Any) -> tuple[int, int, int, int]:
    lin = config.linear_attention
    return lin.conv_dim, lin.value_dim, lin.num_value_heads, lin.num_value_heads


def linear_attention_rules(grouped: bool) -> list[Rule]:
    """Gated DeltaNet: the input projections fused into ``in_proj``; conv, decay, norm, output."""
    prefix = f"{L}linear_attn."
    if grouped:
        parts, sizes = ("in_proj_qkvz", "in_proj_ba"), _grouped_in_proj_sizes
    else:
        parts, sizes = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), _flat_in_proj_sizes
    rules = [Rule("layers.{i}.attn.in_proj.weight", tuple(f"{prefix}{p}.weight" for p in parts), sizes=sizes)]
    for native in ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight"):
        rules.append(Rule(f"layers.{{i}}.attn.{native}", (f"{prefix}{native}",)))
    return rules


class LanguageModelWeightMap(WeightMap):
    """The family's weight map: also reads a multimodal checkpoint's language model
    (``model.language_model.*``; the vision tower is skipped) and maps the MTP layer.

    Qwen3-Next / Qwen3.5 MTP (``mtp.*``) onto the native :class:`~miles_host.models.model.MTPLayer`
    ``mtp.0``: ``fc`` -> ``eh_proj`` (over ``cat(embedding, hidden)``), ``pre_fc_norm_embedding`` ->
    ``enorm``, ``pre_fc_norm_hidden`` -> ``hnorm``, ``norm`` -> ``head_norm``, ``layers.0.*`` -> the
    decoder layer (gated full attention); the embedding and lm head are the model's.
    """

    _LANGUAGE = re.compile(r"model\.language_model\.(.+)")
    _HF_MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\.(.+)")
    _NATIVE_MTP = re.compile(r"mtp\.(\d+)\.(.+)")
    MTP_EXTRA = {
        "mtp.fc.weight": "eh_proj.weight",
        "mtp.pre_fc_norm_embedding.weight": "enorm.weight",
        "mtp.pre_fc_norm_hidden.weight": "hnorm.weight",
        "mtp.norm.weight": "head_norm.weight",
    }

    def __init__(self, rules):
        super().__init__(rules, ignore=(r".*rotary_emb\.inv_freq", r"model\.visual\..*"))

    def _plain(self, name: str) -> str:
        match = self._LANGUAGE.fullmatch(name)
        return f"model.{match.group(1)}" if match else name

    def hf_to_native(self, name):
        name = self._plain(name)
        if name in self.MTP_EXTRA:
            return f"mtp.0.{self.MTP_EXTRA[name]}"
        match = self._HF_MTP_LAYER.fullmatch(name)
        if match:
            native = super().hf_to_native(f"model.layers.{match.group(1)}.{match.group(2)}")
            return None if native is None else f"mtp.{native[len('layers.'):]}"
        return super().hf_to_native(name)

    def convert_hf_tensor(self, name, tensor, config):
        name = self._plain(name)
        if not name.startswith("mtp."):
            return super().convert_hf_tensor(name, tensor, config)
        if not config.num_mtp_layers:
            return []  # a checkpoint whose MTP layers this config does not build
        if name in self.MTP_EXTRA:
            return [(f"mtp.0.{self.MTP_EXTRA[name]}", tensor, None)]
        match = self._HF_MTP_LAYER.fullmatch(name)
        if not match:
            return None
        out = super().convert_hf_tensor(f"model.layers.{match.group(1)}.{match.group(2)}", tensor, config)
        if out is None:
            return None
        return [(f"mtp.{native[len('layers.'):]}", t, index) for native, t, index in out]

    def convert_native_tensor(self, name, tensor, config):
        match = self._NATIVE_MTP.fullmatch(name)
        if match:
            j, rest = match.group(1), match.group(2)
            for hf, native in self.MTP_EXTRA.items():
                if rest == native:
                    return [(hf, tensor)]
            pairs = super().convert_native_tensor(f"layers.{j}.{rest}", tensor, config)
            return [(f"mtp.layers.{j}.{hf[len(f'model.layers.{j}.'):]}", t) for hf, t in pairs]
        pairs = super().convert_native_tensor(name, tensor, config)
        if config.model_type not in MULTIMODAL_TYPES:
            return pairs
        return [(re.sub(r"^model\.", "model.language_model.", hf), t) for hf, t in pairs]


def _weights(grouped: bool, experts: list[Rule]) -> LanguageModelWeightMap:
    return LanguageModelWeightMap(
        common_rules() + norm_rules("llama") + gqa_rules(_gated_qkv_sizes) + linear_attention_rules(grouped) + mlp_rules()
        + experts
    )


MOE_RULES = moe_rules(shared="shared_expert", shared_gate="shared_expert_gate")
QWEN3_NEXT_WEIGHTS = _weights(True, MOE_RULES)
QWEN3_5_WEIGHTS = _weights(False, [])
QWEN3_5_MOE_WEIGHTS = _weights(False, MOE_RULES)


def miles_register_model_families():
    """Three records: the DeltaNet projection layouts and the MLP blocks differ."""
    return [
        model_family(
            "qwen3_next", ("qwen3_next",), config_from_hf, QWEN3_NEXT_WEIGHTS,
            description="Qwen3-Next (Gated DeltaNet + gated attention, MoE with a gated shared expert)",
            chat_defaults=QWEN_CHAT,
        ),
        model_family(
            "qwen3_5", ("qwen3_5", "qwen3_5_text"), config_from_hf, QWEN3_5_WEIGHTS,
            description="Qwen3.5 dense (text; Gated DeltaNet + gated attention)", chat_defaults=QWEN_CHAT,
        ),
        model_family(
            "qwen3_5_moe", ("qwen3_5_moe", "qwen3_5_moe_text"), config_from_hf, QWEN3_5_MOE_WEIGHTS,
            description="Qwen3.5 MoE (text; Gated DeltaNet + gated attention, MoE with a gated shared expert)",
            chat_defaults=QWEN_CHAT,
        ),
    ]


def miles_validate(config, registries):
    """``--true-on-policy`` is refused (with the reason) for models with Gated DeltaNet layers."""
    types = [t for record in miles_register_model_families() for t in record.model_types]
    refuse_true_on_policy(config, types, reason_of=true_on_policy_refusal)
