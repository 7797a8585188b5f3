"""The architecture checks of Megatron's ``MODEL_ARGS``: one :class:`ArchitectureCheck` per flag.

Each record says what the flag must be for a model, read from the family adapter's
native :class:`~miles_host.models.ModelConfig` (``expected``), and what Megatron would
build from the flags given (``actual``, where more than one flag sets it). Megatron's own
spellings of per-layer patterns are parsed here: :func:`moe_layer_pattern`
(``--moe-layer-freq``) and the window layout of ``--window-size`` /
``--window-attn-skip-freq``. :mod:`miles_host.validation.megatron_args` runs them.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Callable

#: returned by an expectation that does not apply to this model (the flag is not checked)
SKIP = object()


@dataclass(frozen=True)
class ArchitectureCheck:
    """One Megatron architecture flag and what the checkpoint says it must be.

    ``expected(native, config) -> value | SKIP``: the flag's value for this model
    (``native``: the family adapter's :class:`~miles_host.models.ModelConfig`).
    ``keys``: the config.json keys it comes from (the first one present is named).
    ``absent_counts``: a boolean switch whose absence describes the model too
    (checked whenever the script gives a full ``MODEL_ARGS`` block: ``--num-layers``,
    ``--hidden-size`` and ``--num-attention-heads``). ``actual(config,
    native)``: the value Megatron would build with, where more than one flag sets it
    (default: the field's value). ``also_when``: checked too when one of these flags is given."""

    field: str
    keys: tuple[str, ...]
    expected: Callable[[Any, Any], Any]
    absent_counts: bool = False
    actual: Callable[[Any, Any], Any] | None = None
    also_when: tuple[str, ...] = ()


def _mla(fn: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    return lambda m, config: fn(m.mla) if m.mla is not None else SKIP


def _gqa(fn: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    return lambda m, config: fn(m) if m.mla is None else SKIP


def _moe(fn: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    return lambda m, config: fn(m.moe) if m.moe is not None else SKIP


def _rope_dim(m: Any) -> int:
    return m.mla.qk_rope_head_dim if m.mla is not None else m.head_dim


def _position_embedding(config: Any, native: Any = None) -> str:
    return "rope" if config.use_rotary_position_embeddings else config.position_embedding_type


def _qkv_bias(config: Any, native: Any = None) -> bool:
    return bool(config.add_qkv_bias or not config.disable_bias_linear)


def _expected_position_embedding(m: Any, config: Any) -> Any:
    # Megatron's MLA models spell yarn either way (--rotary-scaling-factor carries it)
    if m.rope.rope_type == "yarn" and _position_embedding(config) == "yarn":
        return "yarn"
    return "rope"


def _dense_gqa(m: Any, config: Any) -> Any:
    # without --group-query-attention Megatron gives every query head its own KV head
    if m.mla is not None or config.group_query_attention:
        return SKIP
    return m.num_kv_heads < m.num_heads


def _yarn(attribute: str, default: float | None) -> Callable[[Any, Any], Any]:
    """The yarn parameter ``attribute`` of the rope (``default`` when the config has none); yarn models only."""
    def expected(m: Any, config: Any) -> Any:
        if m.rope.rope_type != "yarn":
            return SKIP
        value = getattr(m.rope, attribute)
        return default if value is None else value
    return expected


def moe_layer_pattern(text: str, num_layers: int) -> list[int]:
    """``--moe-layer-freq`` as Megatron reads it: ``N`` (layer ``i`` is MoE when ``i % N == 0``)
    or a Python list expression of 0/1 such as ``[0]*3+[1]*58`` or ``[0, 1, 1]``."""
    text = str(text).strip()
    if not text.startswith("["):
        every = int(text)
        if every < 1:
            raise ValueError(f"--moe-layer-freq {text}: give N >= 1 or a list of 0/1 per layer")
        return [int(i % every == 0) for i in range(num_layers)]
    try:
        pattern = _list_expression(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError) as error:
        raise ValueError(f"--moe-layer-freq {text}: not a list of 0/1 per layer ({error}); "
                         "write it as [0]*K+[1]*M or [0, 1, ...]") from error
    return pattern


def _list_expression(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.List):
        return [int(_list_expression(item)) for item in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _list_expression(node.left), _list_expression(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(f"unexpected {type(node).__name__}")


def _moe_layers(m: Any, config: Any) -> Any:
    return [int(flag) for flag in m.moe_layers] if m.moe is not None else SKIP


def _moe_layer_actual(config: Any, native: Any) -> Any:
    # an integer frequency expands over --num-layers, else over the checkpoint's layers
    return moe_layer_pattern(config.moe_layer_freq, int(config.num_layers or native.num_layers))


def _window(config: Any, native: Any = None) -> Any:
    """``--window-size LEFT,RIGHT``: LEFT, compared with the HF ``sliding_window`` as launch scripts
    write it (upstream miles' gpt-oss script: ``--window-size 128,0`` for ``sliding_window`` 128)."""
    try:
        return int(str(config.window_size).strip("()[] ").split(",")[0])
    except ValueError as error:
        raise ValueError(f"--window-size {config.window_size}: give LEFT,RIGHT (e.g. 128,0)") from error


def _window_layers(config: Any, native: Any) -> Any:
    """Which layers Megatron builds with window attention, 1 per such layer (its ``is_layer_window_attention``)."""
    if config.window_size is None:
        return [0] * native.num_layers
    freq = config.window_attn_skip_freq
    if freq is None:
        return [1] * native.num_layers
    if not str(freq).strip().startswith("["):
        return [int(layer % int(freq) != 0) for layer in range(1, native.num_layers + 1)]
    return [int(bool(flag)) for flag in moe_layer_pattern(freq, native.num_layers)]


def _sliding_layers(m: Any, config: Any) -> Any:
    return [int(kind == "sliding_attention") for kind in m.layer_types]


#: every checked architecture flag (see :class:`ArchitectureCheck`)
ARCHITECTURE_CHECKS: tuple[ArchitectureCheck, ...] = (
    ArchitectureCheck("num_layers", ("num_hidden_layers",), lambda m, c: m.num_layers),
    ArchitectureCheck("hidden_size", ("hidden_size",), lambda m, c: m.hidden_size),
    ArchitectureCheck("ffn_hidden_size", ("intermediate_size",),
                      lambda m, c: m.intermediate_size if m.intermediate_size else SKIP),
    ArchitectureCheck("num_attention_heads", ("num_attention_heads",), lambda m, c: m.num_heads),
    ArchitectureCheck("group_query_attention", ("num_key_value_heads",), _dense_gqa, absent_counts=True),
    ArchitectureCheck("num_query_groups", ("num_key_value_heads",),
                      lambda m, c: m.num_kv_heads if m.mla is None and c.group_query_attention else SKIP),
    ArchitectureCheck("kv_channels", ("head_dim",), _gqa(lambda m: m.head_dim)),
    ArchitectureCheck("normalization", ("rms_norm_eps",), lambda m, c: "RMSNorm", absent_counts=True),
    ArchitectureCheck("norm_epsilon", ("rms_norm_eps",), lambda m, c: m.rms_norm_eps),
    ArchitectureCheck("apply_layernorm_1p", ("model_type",), lambda m, c: m.norm_unit_offset, absent_counts=True),
    ArchitectureCheck("swiglu", ("hidden_act", "hidden_activation"), lambda m, c: m.hidden_act == "silu",
                      absent_counts=True),
    ArchitectureCheck("disable_bias_linear", ("attention_bias", "mlp_bias"),
                      lambda m, c: not (m.o_bias or m.mlp_bias), absent_counts=True),
    ArchitectureCheck("add_qkv_bias", ("attention_bias", "qkv_bias"), lambda m, c: m.qkv_bias, absent_counts=True,
                      actual=_qkv_bias),
    ArchitectureCheck("qk_layernorm", ("use_qk_norm", "model_type"),
                      lambda m, c: m.qk_norm is not None or m.mla is not None, absent_counts=True),
    ArchitectureCheck("post_self_attn_layernorm", ("model_type",), lambda m, c: m.sandwich_norm, absent_counts=True),
    ArchitectureCheck("post_mlp_layernorm", ("model_type",), lambda m, c: m.sandwich_norm, absent_counts=True),
    ArchitectureCheck("untie_embeddings_and_output_weights", ("tie_word_embeddings",),
                      lambda m, c: not m.tie_word_embeddings, absent_counts=True),
    ArchitectureCheck("vocab_size", ("vocab_size",), lambda m, c: m.vocab_size),
    ArchitectureCheck("max_position_embeddings", ("max_position_embeddings",),
                      lambda m, c: m.hf_config.get("max_position_embeddings", SKIP)),
    ArchitectureCheck("position_embedding_type", ("rope_theta", "rope_parameters"), _expected_position_embedding,
                      absent_counts=True, actual=_position_embedding),
    ArchitectureCheck("rotary_base", ("rope_theta", "rope_parameters.rope_theta"), lambda m, c: m.rope.theta),
    ArchitectureCheck("rotary_percent", ("partial_rotary_factor", "rope_parameters.partial_rotary_factor"),
                      lambda m, c: m.rope.rotary_dim / _rope_dim(m)),
    ArchitectureCheck("rotary_interleaved", ("rope_interleave", "model_type"),
                      _gqa(lambda m: m.rope.interleaved), absent_counts=True),
    ArchitectureCheck("rope_type", ("rope_scaling.rope_type", "rope_parameters.rope_type"),
                      lambda m, c: "yarn" if m.rope.rope_type == "yarn" else "rope"),
    ArchitectureCheck("window_size", ("sliding_window",),
                      lambda m, c: m.sliding_window if "sliding_attention" in m.layer_types else None, actual=_window),
    ArchitectureCheck("window_attn_skip_freq", ("layer_types", "max_window_layers"), _sliding_layers,
                      actual=_window_layers, also_when=("window_size",)),
    ArchitectureCheck("use_rope_scaling", ("rope_scaling.rope_type", "rope_parameters.rope_type"),
                      lambda m, c: m.rope.rope_type == "llama3", absent_counts=True),
    ArchitectureCheck("rotary_scaling_factor", ("rope_scaling.factor", "rope_parameters.factor"),
                      lambda m, c: m.rope.factor),
    ArchitectureCheck("original_max_position_embeddings",
                      ("rope_scaling.original_max_position_embeddings",
                       "rope_parameters.original_max_position_embeddings"),
                      _yarn("original_max_position_embeddings", None)),
    ArchitectureCheck("beta_fast", ("rope_scaling.beta_fast", "rope_parameters.beta_fast"), _yarn("beta_fast", 32.0)),
    ArchitectureCheck("beta_slow", ("rope_scaling.beta_slow", "rope_parameters.beta_slow"), _yarn("beta_slow", 1.0)),
    ArchitectureCheck("mscale", ("rope_scaling.mscale", "rope_parameters.mscale"), _yarn("mscale", 1.0)),
    ArchitectureCheck("mscale_all_dim", ("rope_scaling.mscale_all_dim", "rope_parameters.mscale_all_dim"),
                      _yarn("mscale_all_dim", 0.0)),
    ArchitectureCheck("multi_latent_attention", ("kv_lora_rank",), lambda m, c: m.mla is not None, absent_counts=True),
    ArchitectureCheck("q_lora_rank", ("q_lora_rank",), _mla(lambda a: a.q_lora_rank)),
    ArchitectureCheck("kv_lora_rank", ("kv_lora_rank",), _mla(lambda a: a.kv_lora_rank)),
    ArchitectureCheck("qk_head_dim", ("qk_nope_head_dim",), _mla(lambda a: a.qk_nope_head_dim)),
    ArchitectureCheck("qk_pos_emb_head_dim", ("qk_rope_head_dim",), _mla(lambda a: a.qk_rope_head_dim)),
    ArchitectureCheck("v_head_dim", ("v_head_dim",), _mla(lambda a: a.v_head_dim)),
    ArchitectureCheck("num_experts", ("num_experts", "n_routed_experts", "num_local_experts"),
                      lambda m, c: m.moe.num_experts if m.moe is not None else None),
    ArchitectureCheck("moe_router_topk", ("num_experts_per_tok",), _moe(lambda e: e.top_k)),
    ArchitectureCheck("moe_ffn_hidden_size", ("moe_intermediate_size",), _moe(lambda e: e.intermediate_size)),
    ArchitectureCheck("moe_shared_expert_intermediate_size",
                      ("shared_expert_intermediate_size", "n_shared_experts"),
                      _moe(lambda e: e.shared_intermediate_size or None)),
    ArchitectureCheck("moe_shared_expert_gate", ("shared_expert_intermediate_size",),
                      _moe(lambda e: e.shared_expert_gate), absent_counts=True),
    ArchitectureCheck("moe_layer_freq", ("first_k_dense_replace", "mlp_only_layers", "decoder_sparse_step"),
                      _moe_layers, actual=_moe_layer_actual),
    ArchitectureCheck("moe_router_score_function", ("scoring_func", "model_type"), _moe(lambda e: e.score_func),
                      absent_counts=True),
    ArchitectureCheck("moe_router_pre_softmax", ("norm_topk_prob",),
                      _moe(lambda e: (not e.norm_topk_prob) if e.score_func == "softmax" else SKIP),
                      absent_counts=True),
    ArchitectureCheck("moe_router_enable_expert_bias", ("topk_method", "model_type"),
                      _moe(lambda e: e.expert_bias), absent_counts=True),
    ArchitectureCheck("moe_router_topk_scaling_factor", ("routed_scaling_factor",),
                      _moe(lambda e: e.routed_scaling_factor)),
    ArchitectureCheck("moe_router_num_groups", ("n_group",), _moe(lambda e: e.n_group)),
    ArchitectureCheck("moe_router_group_topk", ("topk_group",), _moe(lambda e: e.topk_group)),
)

#: a MoE switch whose absence is checked only when the script describes the MoE block (--num-experts)
MOE_SWITCHES = ("moe_shared_expert_gate", "moe_router_score_function", "moe_router_pre_softmax",
                 "moe_router_enable_expert_bias")


def architecture_fields() -> tuple[str, ...]:
    """The fields the architecture checks read (``--spec`` aside)."""
    return tuple(check.field for check in ARCHITECTURE_CHECKS)
