"""The native model configuration: one dataclass for every model family.

Family adapters (``plugins/models``) build a :class:`ModelConfig` from a
Hugging Face ``config.json``; the blocks in :mod:`miles_host.models` read only
this. The original HF dict is kept in ``hf_config`` so a save round trip writes
back every field, including the ones miles does not use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention")
#: how routed experts train (:mod:`miles_host.kernels.moe_train`): grouped GEMM where it runs fast,
#: grouped GEMM everywhere, or the per-expert loop
EXPERTS_IMPLS = ("auto", "grouped", "loop")


@dataclass
class RopeConfig:
    """Rotary position embedding of one attention kind.

    ``rotary_dim`` dims of each head are rotated (partial rotary when smaller
    than the head dim; the rest passes through). ``interleaved``: rotate pairs
    ``(x0, x1), (x2, x3), ...`` (GLM-4, DeepSeek ``rope_interleave``) instead of
    halves ``(x_i, x_{i+d/2})`` (Llama/NeoX). Scaling parameters follow the HF
    ``rope_parameters`` names.
    """

    rotary_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    interleaved: bool = False
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even number, got {self.rotary_dim}")
        if self.rope_type in ("llama3", "yarn") and self.original_max_position_embeddings is None:
            raise ValueError(f"rope_type {self.rope_type!r} needs original_max_position_embeddings")


@dataclass
class MLAConfig:
    """DeepSeek multi-head latent attention dimensions (``q_lora_rank=None``: plain q_proj)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass
class DSAConfig:
    """DeepSeek Sparse Attention (DeepSeek-V3.2): a lightning indexer over MLA.

    The indexer scores every causal key of a query with ``index_n_heads`` heads of
    ``index_head_dim`` dims; the query then attends only to its ``index_topk``
    best keys (all of them while its context is shorter). See :mod:`miles_host.models.dsa`.
    """

    index_n_heads: int
    index_head_dim: int
    index_topk: int

    def __post_init__(self) -> None:
        for name in ("index_n_heads", "index_head_dim", "index_topk"):
            if getattr(self, name) <= 0:
                raise ValueError(f"DSAConfig.{name} must be positive, got {getattr(self, name)}")


@dataclass
class Gemma3nConfig:
    """Gemma-3n's text decoder (see :mod:`miles_host.models.gemma3n`).

    Per-layer embeddings of ``hidden_size_per_layer_input`` dims (a token table of
    ``vocab_size_per_layer_input`` rows plus a projection of the embedding), ``altup_num_inputs``
    AltUp streams (``altup_active_idx`` goes through the layers; coefficients clipped to
    ``altup_coef_clip`` in training), LAuReL of rank ``laurel_rank``, per-layer MLP widths
    ``intermediate_sizes`` and activation sparsity (``activation_sparsity``: the fraction of
    gate activations a Gaussian top-k zeroes, 0 = dense), and KV sharing: ``kv_source[i]`` is the
    earlier layer whose keys and values layer ``i`` attends with (None: its own).
    """

    hidden_size_per_layer_input: int
    vocab_size_per_layer_input: int
    altup_num_inputs: int
    altup_active_idx: int
    altup_coef_clip: float | None
    altup_correct_scale: bool
    laurel_rank: int
    intermediate_sizes: list[int]
    activation_sparsity: list[float]
    kv_source: list[int | None]


@dataclass
class MoEConfig:
    """Mixture-of-experts block.

    ``score_func``: ``softmax`` (Qwen) or ``sigmoid`` (DeepSeek-V3, GLM-4.5,
    MiniMax-M2). ``expert_bias``: a per-expert bias added to the scores for the
    choice only (``e_score_correction_bias``). ``n_group``/``topk_group``:
    group-limited routing (groups scored by their top-2 sum). Shared experts:
    ``shared_intermediate_size`` (0 = none), gated by ``sigmoid(shared_gate(x))``
    when ``shared_expert_gate`` (Qwen2-MoE). ``router_fp32``: router matmul in
    float32 whatever the model dtype (DeepSeek, GLM). ``experts_impl``: the routed
    experts' gradient-enabled forward, one of :data:`EXPERTS_IMPLS` (``auto``: grouped
    GEMM where ``torch._grouped_mm`` runs its bf16 kernel, the per-expert loop elsewhere;
    ``loop``: always the per-expert loop). Variants (:mod:`miles_host.models.moe_variants`):
    ``router_bias`` (a bias in the router linear, gpt-oss), ``expert_biases`` (biases on
    each expert's projections), ``swiglu_limit``/``swiglu_alpha`` (gpt-oss' clamped SwiGLU
    ``(clamp(up) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``),
    ``scale_expert_inputs`` (Llama-4: each expert gets ``weight * x`` and its output is
    summed unweighted).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    score_func: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    expert_bias: bool = False
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    router_fp32: bool = False
    norm_eps: float = 0.0
    experts_impl: str = "auto"
    router_bias: bool = False
    expert_biases: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    scale_expert_inputs: bool = False

    def __post_init__(self) -> None:
        if self.experts_impl not in EXPERTS_IMPLS:
            raise ValueError(f"unsupported MoE experts_impl {self.experts_impl!r}; use one of {', '.join(EXPERTS_IMPLS)}")
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported MoE score_func {self.score_func!r}; use 'softmax' or 'sigmoid'")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"MoE top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(
                f"MoE group routing needs num_experts ({self.num_experts}) divisible by n_group "
                f"({self.n_group}) and 0 < topk_group ({self.topk_group}) <= n_group"
            )


@dataclass
class ModelConfig:
    """Everything the native blocks need to build one decoder-only LM.

    Per-layer choices are lists of length ``num_layers``: ``layer_types``
    (full or sliding-window attention) and ``moe_layers`` (MoE block or dense
    MLP). ``local_rope`` is the rotary of sliding layers when it differs
    (Gemma-3). ``qk_norm``: ``None``, ``"head"`` (RMSNorm over each head) or
    ``"full"`` (over all heads at once, MiniMax-M2). ``sandwich_norm``: extra
    RMSNorms after the attention and MLP outputs (Gemma-2/3, GLM-4).
    Variants (:mod:`miles_host.models.attention_variants`): ``attn_sinks`` (a learned
    per-head sink logit in every softmax, gpt-oss); ``chunked_attention`` layers see only
    the keys of their own ``attention_chunk_size`` block (Llama-4); ``nope_layers`` (no
    rotary on those layers); ``qk_norm="l2"`` (weightless RMS norm of q and k after the
    rotary, rotary layers only); ``attn_temperature = (floor_scale, attn_scale)`` scales
    the queries of NoPE layers by ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))``
    (they read the positions from ``nope_rope``, a ``PositionsOnly`` table).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope: RopeConfig
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    norm_unit_offset: bool = False
    embed_scale: float | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: str | None = None
    sandwich_norm: bool = False
    attn_scale: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    local_rope: RopeConfig | None = None
    mla: MLAConfig | None = None
    dsa: DSAConfig | None = None
    gemma3n: Gemma3nConfig | None = None
    moe: MoEConfig | None = None
    moe_layers: list[bool] = field(default_factory=list)
    num_mtp_layers: int = 0
    attention_chunk_size: int | None = None
    attn_sinks: bool = False
    nope_layers: list[bool] = field(default_factory=list)
    attn_temperature: tuple[float, float] | None = None
    nope_rope: RopeConfig | None = None
    #: Gated DeltaNet dimensions of ``linear_attention`` layers (:mod:`miles_host.models.gated_deltanet`)
    linear_attention: Any = None
    #: full attention scales its output by a per-head ``sigmoid`` gate from ``q_proj`` (Qwen3-Next / Qwen3.5)
    attn_output_gate: bool = False
    #: MTP layers read the model's embedding and lm head (no private copies in the checkpoint; Qwen3-Next)
    mtp_shared_embeddings: bool = False
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)
    generation_config: dict[str, Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        if self.qk_norm not in (None, "head", "full", "l2"):
            raise ValueError(f"qk_norm must be None, 'head', 'full' or 'l2', got {self.qk_norm!r}")
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_layers
        if not self.moe_layers:
            self.moe_layers = [self.moe is not None] * self.num_layers
        if not self.nope_layers:
            self.nope_layers = [False] * self.num_layers
        for name in ("layer_types", "moe_layers", "nope_layers"):
            if len(getattr(self, name)) != self.num_layers:
                raise ValueError(f"ModelConfig.{name} has {len(getattr(self, name))} entries for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"unsupported layer types {bad}; supported: {', '.join(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a positive sliding_window")
        if "chunked_attention" in self.layer_types and not self.attention_chunk_size:
            raise ValueError("chunked_attention layers need a positive attention_chunk_size")
        if "linear_attention" in self.layer_types and self.linear_attention is None:
            raise ValueError("linear_attention layers need ModelConfig.linear_attention (a GatedDeltaNetConfig)")
        if any(self.moe_layers) and self.moe is None:
            raise ValueError("moe_layers marks MoE layers but ModelConfig.moe is None")
        if self.dsa is not None and (self.mla is None or self.mla.q_lora_rank is None):
            raise ValueError("DSA (a lightning indexer) needs MLA with a q_lora_rank: its queries read the q latent")
        rope_dim = self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim
        if self.rope.rotary_dim > rope_dim:
            raise ValueError(f"rotary_dim ({self.rope.rotary_dim}) exceeds the rotated head dim ({rope_dim})")

    @property
    def qk_head_dim(self) -> int:
        """Head dim of queries and keys (MLA: nope + rope)."""
        return self.mla.qk_head_dim if self.mla is not None else self.head_dim

    @property
    def v_head_dim(self) -> int:
        """Head dim of values (MLA may differ from the key head dim)."""
        return self.mla.v_head_dim if self.mla is not None else self.head_dim

    def sliding_window_of(self, layer_index: int) -> int | None:
        """The attention window of one layer (None: full causal attention)."""
        if layer_index >= self.num_layers:  # MTP layers attend like full layers
            return None
        return self.sliding_window if self.layer_types[layer_index] == "sliding_attention" else None

    def chunk_size_of(self, layer_index: int) -> int | None:
        """The local-attention chunk of one layer (None: not a chunked layer)."""
        if layer_index >= self.num_layers or self.layer_types[layer_index] != "chunked_attention":
            return None
        return self.attention_chunk_size

    def rope_of(self, layer_index: int) -> RopeConfig:
        """The rotary config of one layer (sliding layers may use ``local_rope``)."""
        if self.nope_rope is not None and layer_index < self.num_layers and self.nope_layers[layer_index]:
            return self.nope_rope
        if self.local_rope is not None and self.sliding_window_of(layer_index) is not None:
            return self.local_rope
        return self.rope
