"""HF ``config.json`` -> native :class:`ModelConfig` helpers shared by the families.

Reads both the transformers-5 layout (``rope_parameters``, possibly nested per
layer type) and the older one (``rope_theta`` + ``rope_scaling``), with each
family's transformers defaults for absent keys.
"""

from __future__ import annotations

from typing import Any, Mapping

from miles_host.models.config import ModelConfig, MoEConfig, RopeConfig

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}


def activation(hf: Mapping[str, Any], default: str = "silu") -> str:
    """Native activation name from ``hidden_act`` / ``hidden_activation``."""
    name = hf.get("hidden_activation") or hf.get("hidden_act") or default
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r} in config.json; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def rope_config(
    hf: Mapping[str, Any],
    head_dim: int,
    *,
    default_theta: float = 10000.0,
    default_partial: float = 1.0,
    layer_type: str | None = None,
    interleaved: bool = False,
    rotary_dim: int | None = None,
) -> RopeConfig:
    """The rope of one attention kind (``layer_type`` picks a nested entry)."""
    params = dict(hf.get("rope_parameters") or {})
    if layer_type is not None and isinstance(params.get(layer_type), Mapping):
        params = dict(params[layer_type])
    elif any(isinstance(v, Mapping) for v in params.values()):
        params = dict(params.get("full_attention") or {})
    legacy = hf.get("rope_scaling") or {}
    merged = {**legacy, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    theta = merged.get("rope_theta", hf.get("rope_theta", default_theta))
    partial = merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", default_partial))
    if rotary_dim is None:
        rotary_dim = int(head_dim * partial)
    original = merged.get("original_max_position_embeddings")
    if original is None and rope_type in ("llama3", "yarn"):
        original = hf.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
    factor = merged.get("factor")
    if factor is None and rope_type == "yarn":
        factor = hf["max_position_embeddings"] / original
    return RopeConfig(
        rotary_dim=rotary_dim,
        theta=float(theta),
        rope_type=rope_type,
        interleaved=interleaved,
        factor=float(factor if factor is not None else 1.0),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        mscale=merged.get("mscale"),
        mscale_all_dim=merged.get("mscale_all_dim"),
        attention_factor=merged.get("attention_factor"),
        truncate=bool(merged.get("truncate", True)),
    )


def base_fields(hf: Mapping[str, Any], *, tie_default: bool = False) -> dict[str, Any]:
    """The fields every family reads the same way."""
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return dict(
        model_type=hf["model_type"],
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=hf.get("intermediate_size", 0),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        hidden_act=activation(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", tie_default)),
        hf_config=dict(hf),
    )


def layer_types(hf: Mapping[str, Any], num_layers: int) -> tuple[list[str], int | None]:
    """``(layer_types, sliding_window)`` from ``layer_types`` or the older flags."""
    window = hf.get("sliding_window") or None
    types = hf.get("layer_types")
    if types:
        types = list(types)[:num_layers]
        return types, (window if "sliding_attention" in types else None)
    if window and hf.get("use_sliding_window", False):
        first = hf.get("max_window_layers", num_layers)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        return types, window
    return ["full_attention"] * num_layers, None


def moe_layer_flags(hf: Mapping[str, Any], num_layers: int, *, num_experts: int) -> list[bool]:
    """Which layers are MoE: ``first_k_dense_replace``, ``mlp_only_layers``, ``decoder_sparse_step``."""
    if num_experts <= 0:
        return [False] * num_layers
    if "mlp_layer_types" in hf and hf["mlp_layer_types"]:
        return [t == "sparse" for t in hf["mlp_layer_types"]][:num_layers]
    first_dense = hf.get("first_k_dense_replace", 0) or 0
    only_mlp = set(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step", 1) or 1
    return [i >= first_dense and i not in only_mlp and (i + 1) % step == 0 for i in range(num_layers)]


def sigmoid_group_moe(
    hf: Mapping[str, Any], fields: dict[str, Any], *, first_k_dense_default: int, scaling_default: float
) -> MoEConfig:
    """DeepSeek-V3-style routing (GLM-4-MoE shares it): sigmoid scores, group-limited
    top-k, expert-score bias, shared experts, fp32 router. Also fills
    ``fields["moe_layers"]`` and ``fields["num_mtp_layers"]``."""
    num_experts = hf.get("n_routed_experts") or hf.get("num_local_experts") or 0
    fields["moe_layers"] = moe_layer_flags(
        {"first_k_dense_replace": hf.get("first_k_dense_replace", first_k_dense_default)},
        fields["num_layers"],
        num_experts=num_experts,
    )
    fields["num_mtp_layers"] = int(hf.get("num_nextn_predict_layers", 0) or 0)
    return MoEConfig(
        num_experts=num_experts,
        top_k=hf["num_experts_per_tok"],
        intermediate_size=hf["moe_intermediate_size"],
        score_func="sigmoid",
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", scaling_default)),
        n_group=hf.get("n_group") or 1,
        topk_group=hf.get("topk_group") or 1,
        expert_bias=True,
        shared_intermediate_size=hf["moe_intermediate_size"] * (hf.get("n_shared_experts") or 0),
        router_fp32=True,
        norm_eps=1e-20,
    )


def build(fields: dict[str, Any], moe: MoEConfig | None = None) -> ModelConfig:
    """Construct the native config, turning dataclass validation into clear errors."""
    try:
        return ModelConfig(moe=moe, **fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config.json of model_type {fields.get('model_type')!r} is not usable: {exc}") from exc


def hf_config_from_native(config: ModelConfig, original: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The HF config to save: the original dict (every field kept)."""
    return dict(original if original is not None else config.hf_config)
