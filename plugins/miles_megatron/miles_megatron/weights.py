"""Native (miles) <-> Megatron-Core GPTModel state dicts.

Every model-family adapter maps HF checkpoints onto one native layout
(``miles_host.models``), so one map from the native layout to Megatron-Core's
names covers every family; the per-family differences that matter here are
read from the native :class:`~miles_host.models.ModelConfig`. Both directions
are pure functions over ``{name: tensor}`` and are exact inverses.

Megatron-Core conventions used (local layer spec, no TransformerEngine):

- ``decoder.layers.{i}.self_attention.linear_qkv`` holds q, k, v interleaved per
  query group: for each KV head, its ``num_heads / num_kv_heads`` query heads,
  then its key head, then its value head. miles keeps ``[q; k; v]``.
- MLA (DeepSeek; :mod:`miles_megatron.mla`): native ``q_a_proj`` / ``q_a_norm`` /
  ``q_b_proj`` (or ``q_proj``), ``kv_a_proj`` / ``kv_a_norm`` / ``kv_b_proj``, ``o_proj``
  (HF's ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` / ``q_proj``, ``kv_a_proj_with_mqa``,
  ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``) are Megatron's ``linear_q_down_proj``,
  ``q_layernorm``, ``linear_q_up_proj`` / ``linear_q_proj``, ``linear_kv_down_proj``,
  ``kv_layernorm``, ``linear_kv_up_proj``, ``linear_proj``, layouts unchanged (both
  split each head's query/key into ``[nope, rope]`` and the latent into
  ``[kv_lora_rank, rope]``).
- MoE routing (:mod:`miles_megatron.moe_routing`): ``router.weight``, the expert bias
  (DeepSeek's ``e_score_correction_bias``) as ``router.expert_bias``, shared experts as
  ``shared_experts.linear_fc{1,2}``.
- SwiGLU ``linear_fc1`` is ``[gate; up]``, as miles' ``gate_up_proj``.
- Routed experts as ``mlp.experts.local_experts.{e}.linear_fc{1,2}`` (SequentialMLP's layout, which
  :class:`~miles_megatron.grouped_experts.GroupedSequentialMLP` keeps).
- MTP (draft) layers: native ``mtp.{j}.*`` (:class:`~miles_host.models.model.MTPLayer`)
  <-> Megatron's ``mtp.layers.{j}.*`` (``MultiTokenPredictionLayer``): ``enorm``,
  ``hnorm``, ``eh_proj``, ``head_norm`` -> ``final_layernorm``, and the decoder layer
  under ``transformer_layer.`` with the decoder layers' names. The embedding and output
  head are the policy's (Megatron's MTP has no private copies: DeepSeek's are refused).
- Post-attention / post-MLP ("sandwich") norms of Gemma and GLM-4 use the names
  Megatron-Bridge gives them (``post_self_attn_layernorm``, ``post_mlp_layernorm``);
  stock GPTModel layer specs have no such modules, so the backend needs a layer
  spec with them for those families.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import torch

from miles_megatron.mla import mla_config_kwargs, mla_problems
from miles_megatron.moe_routing import moe_config_kwargs, moe_problems
from miles_megatron.rope import rope_config_kwargs, rotary_percent

Tensors = dict[str, torch.Tensor]

#: per-layer names that are a plain rename (native suffix -> Megatron suffix)
LAYER_RENAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "pre_mlp_layernorm.weight",
    "post_attn_norm.weight": "post_self_attn_layernorm.weight",
    "post_mlp_norm.weight": "post_mlp_layernorm.weight",
    "attn.o_proj.weight": "self_attention.linear_proj.weight",
    "attn.o_proj.bias": "self_attention.linear_proj.bias",
    "attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "attn.q_a_proj.weight": "self_attention.linear_q_down_proj.weight",
    "attn.q_a_norm.weight": "self_attention.q_layernorm.weight",
    "attn.q_b_proj.weight": "self_attention.linear_q_up_proj.weight",
    "attn.q_proj.weight": "self_attention.linear_q_proj.weight",
    "attn.kv_a_proj.weight": "self_attention.linear_kv_down_proj.weight",
    "attn.kv_a_norm.weight": "self_attention.kv_layernorm.weight",
    "attn.kv_b_proj.weight": "self_attention.linear_kv_up_proj.weight",
    "mlp.gate_up_proj.weight": "mlp.linear_fc1.weight",
    "mlp.gate_up_proj.bias": "mlp.linear_fc1.bias",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "mlp.down_proj.bias": "mlp.linear_fc2.bias",
    "mlp.router.weight": "mlp.router.weight",
    "mlp.router.expert_bias": "mlp.router.expert_bias",
    "mlp.shared_experts.gate_up_proj.weight": "mlp.shared_experts.linear_fc1.weight",
    "mlp.shared_experts.down_proj.weight": "mlp.shared_experts.linear_fc2.weight",
    "mlp.shared_gate.weight": "mlp.shared_experts.gate_weight",
}
GLOBAL_RENAMES: dict[str, str] = {
    "embed_tokens.weight": "embedding.word_embeddings.weight",
    "norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}
#: MTP-layer names besides its decoder layer (native suffix -> Megatron suffix)
MTP_RENAMES: dict[str, str] = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "head_norm.weight": "final_layernorm.weight",
}
_NATIVE_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_MEGATRON_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_NATIVE_MTP = re.compile(r"^mtp\.(\d+)\.(.+)$")
_MEGATRON_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_MEGATRON_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def qkv_to_megatron(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """``[q; k; v]`` rows (weight or bias) -> Megatron's per-query-group interleave."""
    per_group = num_heads // num_kv_heads
    rest = qkv.shape[1:]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim])
    q = q.reshape(num_kv_heads, per_group * head_dim, *rest)
    k = k.reshape(num_kv_heads, head_dim, *rest)
    v = v.reshape(num_kv_heads, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def qkv_from_megatron(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`qkv_to_megatron`."""
    per_group = num_heads // num_kv_heads
    rest = qkv.shape[1:]
    grouped = qkv.reshape(num_kv_heads, (per_group + 2) * head_dim, *rest)
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return torch.cat([q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)])


def _invert(mapping: Mapping[str, str]) -> dict[str, str]:
    inverse: dict[str, str] = {}
    for native, megatron in mapping.items():
        # q_norm (GQA) and q_a_norm (MLA) share Megatron's q_layernorm: one model has only one
        inverse.setdefault(megatron, native)
    return inverse


def _layer_map(config: Any) -> dict[str, str]:
    renames = dict(LAYER_RENAMES)
    if config.mla is not None:
        renames["attn.q_a_norm.weight"] = "self_attention.q_layernorm.weight"
        renames.pop("attn.q_norm.weight")
    return renames


def native_to_megatron(state: Mapping[str, torch.Tensor], config: Any) -> Tensors:
    """A native state dict -> Megatron-Core GPTModel names and layouts."""
    renames = _layer_map(config)
    out: Tensors = {}
    for name, tensor in state.items():
        if name in GLOBAL_RENAMES:
            out[GLOBAL_RENAMES[name]] = tensor
            continue
        layer, mtp = _NATIVE_LAYER.match(name), _NATIVE_MTP.match(name)
        if layer is not None:
            _layer_to_megatron(name, layer.group(2), tensor, f"decoder.layers.{layer.group(1)}.", config, renames, out)
        elif mtp is not None and mtp.group(2) in MTP_RENAMES:
            out[f"mtp.layers.{mtp.group(1)}.{MTP_RENAMES[mtp.group(2)]}"] = tensor
        elif mtp is not None and mtp.group(2).split(".")[0] in ("embed_tokens", "head"):
            raise ValueError(f"native weight {name!r}: Megatron's MTP layers share the policy's embedding and "
                             "output head (no private copies, as DeepSeek checkpoints have); use --train-backend native")
        elif mtp is not None:
            prefix = f"mtp.layers.{mtp.group(1)}.transformer_layer."
            _layer_to_megatron(name, mtp.group(2), tensor, prefix, config, renames, out)
        else:
            raise ValueError(f"no Megatron-Core name for native weight {name!r}")
    return out


def _layer_to_megatron(name: str, suffix: str, tensor: torch.Tensor, prefix: str, config: Any,
                       renames: Mapping[str, str], out: Tensors) -> None:
    """One decoder-layer weight (native ``suffix``) into ``out`` under Megatron's ``prefix``."""
    if suffix in ("attn.qkv_proj.weight", "attn.qkv_proj.bias"):
        kind = suffix.rsplit(".", 1)[1]
        out[f"{prefix}self_attention.linear_qkv.{kind}"] = qkv_to_megatron(
            tensor, config.num_heads, config.num_kv_heads, config.head_dim
        )
    elif suffix in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        fc = "linear_fc1" if "gate_up" in suffix else "linear_fc2"
        for expert, weight in enumerate(tensor.unbind(0)):
            out[f"{prefix}mlp.experts.local_experts.{expert}.{fc}.weight"] = weight
    elif suffix in renames:
        out[prefix + renames[suffix]] = tensor
    else:
        raise ValueError(f"no Megatron-Core name for native weight {name!r}")


def megatron_to_native(state: Mapping[str, torch.Tensor], config: Any) -> Tensors:
    """Inverse of :func:`native_to_megatron`."""
    inverse_layer = _invert(_layer_map(config))
    inverse_global = _invert(GLOBAL_RENAMES)
    inverse_mtp = _invert(MTP_RENAMES)
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    out: Tensors = {}
    for name, tensor in state.items():
        if name in inverse_global:
            out[inverse_global[name]] = tensor
            continue
        layer, mtp = _MEGATRON_LAYER.match(name), _MEGATRON_MTP.match(name)
        if layer is not None:
            native_prefix, suffix = f"layers.{layer.group(1)}.", layer.group(2)
        elif mtp is not None and mtp.group(2) in inverse_mtp:
            out[f"mtp.{mtp.group(1)}.{inverse_mtp[mtp.group(2)]}"] = tensor
            continue
        elif mtp is not None and mtp.group(2).startswith("transformer_layer."):
            native_prefix, suffix = f"mtp.{mtp.group(1)}.", mtp.group(2).removeprefix("transformer_layer.")
        else:
            raise ValueError(f"unexpected Megatron-Core weight {name!r}")
        expert = _MEGATRON_EXPERT.match(suffix)
        if suffix.startswith("self_attention.linear_qkv."):
            kind = suffix.rsplit(".", 1)[1]
            out[f"{native_prefix}attn.qkv_proj.{kind}"] = qkv_from_megatron(
                tensor, config.num_heads, config.num_kv_heads, config.head_dim
            )
        elif expert is not None:
            experts.setdefault((native_prefix, expert.group(2)), {})[int(expert.group(1))] = tensor
        elif suffix in inverse_layer:
            out[native_prefix + inverse_layer[suffix]] = tensor
        else:
            raise ValueError(f"unexpected Megatron-Core weight {name!r}")
    for (native_prefix, fc), by_expert in experts.items():
        native = "gate_up_proj" if fc == "linear_fc1" else "down_proj"
        out[f"{native_prefix}mlp.experts.{native}"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def megatron_transformer_config_kwargs(config: Any) -> dict[str, Any]:
    """Megatron-Core ``TransformerConfig`` arguments for a native config (what
    the backend builds its GPTModel from); features Megatron's GPT layer spec
    cannot express are refused with the feature named."""
    unsupported: list[tuple[bool, str]] = [
        (config.attn_logit_softcap is not None, "attention logit soft-capping (Gemma-2)"),
        (config.final_logit_softcap is not None, "final logit soft-capping (Gemma-2)"),
        (config.sandwich_norm, "post-attention/post-MLP norms (Gemma, GLM-4): need a custom layer spec"),
        ("sliding_attention" in config.layer_types, "sliding-window layers"),
        (config.mla is None and config.rope.rope_type != "default", f"rope scaling {config.rope.rope_type!r}"),
        (config.qk_norm == "full", "q/k norm over all heads (MiniMax-M2)"),
        (config.o_bias or config.mlp_bias, "output-projection or MLP biases"),
        (config.norm_unit_offset or config.embed_scale is not None, "Gemma's (1+w) norms / embedding scale"),
        (config.attn_sinks, "attention sinks (gpt-oss)"),
        ("chunked_attention" in config.layer_types, "chunked local attention (Llama-4)"),
        (any(config.nope_layers) or config.qk_norm == "l2", "NoPE layers / L2 q-k norm (Llama-4)"),
    ]
    problems = [what for bad, what in unsupported if bad]
    if config.mla is not None:
        problems += mla_problems(config)
    if config.moe is not None:
        problems += moe_problems(config.moe)
    if problems:
        raise ValueError(f"the megatron backend does not support {', '.join(problems)} yet; use --train-backend native")
    kwargs: dict[str, Any] = {
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_heads,
        "num_query_groups": config.num_kv_heads,
        "kv_channels": config.head_dim,
        "ffn_hidden_size": config.intermediate_size,
        "normalization": "RMSNorm",
        "layernorm_epsilon": config.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": _activation(config.hidden_act),
        "add_bias_linear": False,
        "add_qkv_bias": config.qkv_bias,
        "qk_layernorm": config.qk_norm == "head",
    }
    if config.mla is not None:
        kwargs.update(mla_config_kwargs(config))
    else:
        kwargs.update(rope_config_kwargs(config))
    if config.moe is not None:
        kwargs.update(moe_config_kwargs(config.moe, config.moe_layers))
    return kwargs


def gpt_model_kwargs(config: Any) -> dict[str, Any]:
    """Megatron-Core ``GPTModel`` arguments besides the ``TransformerConfig`` (a partial
    rotary as ``rotary_percent``, :mod:`miles_megatron.rope`)."""
    kwargs = {
        "vocab_size": config.vocab_size,
        "max_sequence_length": int(config.hf_config.get("max_position_embeddings", 4096)),
        "position_embedding_type": "rope",
        "rotary_base": int(config.rope.theta),
        "share_embeddings_and_output_weights": bool(config.tie_word_embeddings),
    }
    if config.mla is None:
        kwargs["rotary_percent"] = rotary_percent(config)
    return kwargs


def _activation(name: str):
    import torch.nn.functional as F

    functions = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
    return functions[name]


ConvertFn = Callable[[Mapping[str, torch.Tensor], Any], Tensors]
