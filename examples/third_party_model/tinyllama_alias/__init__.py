"""Example third-party miles plugin: model_type ``my_llama``.

Llama blocks, GPT-style checkpoint names::

    transformer.wte.weight                 -> embed_tokens.weight
    transformer.h.{i}.ln_1.weight          -> layers.{i}.attn_norm.weight
    transformer.h.{i}.attn.wq/wk/wv.weight -> layers.{i}.attn.qkv_proj.weight (rows of q | k | v)
    transformer.h.{i}.attn.wo.weight       -> layers.{i}.attn.o_proj.weight
    transformer.h.{i}.ln_2.weight          -> layers.{i}.mlp_norm.weight
    transformer.h.{i}.mlp.w_gate/w_up      -> layers.{i}.mlp.gate_up_proj.weight (rows of gate | up)
    transformer.h.{i}.mlp.w_down.weight    -> layers.{i}.mlp.down_proj.weight
    transformer.ln_f.weight                -> norm.weight
    lm_head.weight                         -> lm_head.weight

Only the host's public API is used (``miles_host.records``, ``miles_host.models``).
"""

from __future__ import annotations

import re

from miles_host.models import ModelConfig, RopeConfig
from miles_host.records import ModelFamily

always_active = True

_RENAMES = {
    "transformer.wte.weight": "embed_tokens.weight",
    "transformer.ln_f.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_LAYER_RENAMES = {
    "ln_1.weight": "attn_norm.weight",
    "ln_2.weight": "mlp_norm.weight",
    "attn.wo.weight": "attn.o_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}
#: fused native tensor -> its HF parts, in row order
_FUSED = {
    "attn.qkv_proj.weight": ("attn.wq.weight", "attn.wk.weight", "attn.wv.weight"),
    "mlp.gate_up_proj.weight": ("mlp.w_gate.weight", "mlp.w_up.weight"),
}
_LAYER = re.compile(r"transformer\.h\.(\d+)\.(.+)")
_NATIVE_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def config_from_hf(hf: dict) -> ModelConfig:
    """Native config: a plain Llama (no biases, default or llama3 rope)."""
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return ModelConfig(
        model_type=hf["model_type"],
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        head_dim=head_dim,
        intermediate_size=hf["intermediate_size"],
        rope=RopeConfig(rotary_dim=head_dim, theta=float(hf.get("rope_theta", 10000.0))),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        hf_config=dict(hf),
    )


def _part_sizes(native_rest: str, config: ModelConfig) -> tuple[int, ...]:
    if native_rest.startswith("attn."):
        kv = config.num_kv_heads * config.head_dim
        return config.num_heads * config.head_dim, kv, kv
    return config.intermediate_size, config.intermediate_size


def convert_hf_tensor(name, tensor, config):
    """``[(native_name, tensor, index)]``: where a checkpoint tensor goes."""
    if name in _RENAMES:
        return [(_RENAMES[name], tensor, None)]
    match = _LAYER.fullmatch(name)
    if not match:
        return None  # unknown: the loader reports it as unexpected
    layer, rest = match.groups()
    if rest in _LAYER_RENAMES:
        return [(f"layers.{layer}.{_LAYER_RENAMES[rest]}", tensor, None)]
    for native_rest, parts in _FUSED.items():
        if rest in parts:
            sizes = _part_sizes(native_rest, config)
            k = parts.index(rest)
            start = sum(sizes[:k])
            return [(f"layers.{layer}.{native_rest}", tensor, (slice(start, start + sizes[k]),))]
    return None


def convert_native_tensor(name, tensor, config):
    """``[(hf_name, tensor)]``: the checkpoint tensors of one native tensor."""
    inverse = {native: hf for hf, native in _RENAMES.items()}
    if name in inverse:
        return [(inverse[name], tensor)]
    layer, rest = _NATIVE_LAYER.fullmatch(name).groups()
    for hf_rest, native_rest in _LAYER_RENAMES.items():
        if rest == native_rest:
            return [(f"transformer.h.{layer}.{hf_rest}", tensor)]
    parts = _FUSED[rest]
    chunks = tensor.split(list(_part_sizes(rest, config)), dim=0)
    return [(f"transformer.h.{layer}.{hf_rest}", chunk) for hf_rest, chunk in zip(parts, chunks)]


def hf_to_native(name: str) -> str:
    """Name-only mapping (unused by the loader when convert_hf_tensor answers)."""
    return name


def native_to_hf(name: str) -> str:
    """Name-only mapping (unused by save_pretrained when convert_native_tensor is set)."""
    return name


def miles_register_model_families():
    """One family handling ``my_llama``."""
    return [
        ModelFamily(
            name="my_llama",
            description="Llama blocks with GPT-style weight names (example plugin)",
            model_types=("my_llama",),
            config_from_hf=config_from_hf,
            hf_to_native=hf_to_native,
            native_to_hf=native_to_hf,
            convert_hf_tensor=convert_hf_tensor,
            convert_native_tensor=convert_native_tensor,
            chat_defaults={"eos_tokens": ["</s>"]},
        )
    ]
