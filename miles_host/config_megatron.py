"""Megatron-LM's model-architecture and performance flags, as slime's launch scripts pass them.

miles builds the model from ``--hf-checkpoint``'s ``config.json``; the architecture flags
(slime's ``MODEL_ARGS``) are accepted so those scripts run as written, and checked
against that config (:mod:`miles_host.validation.megatron_args`): a value that disagrees
is an error naming both. Spellings, types and defaults are Megatron-LM's
(``megatron/training/arguments.py``) except where the help says otherwise.

The performance / precision flags (slime's ``PERF_ARGS``) reach Megatron-Core's
``TransformerConfig`` under ``--train-backend megatron`` where that backend can honour
them (:data:`MEGATRON_BACKEND_FIELDS`); otherwise they are on the accepted-and-ignored
list (:mod:`miles_host.validation.ignored_flags`) or refused when the value asks for
something no backend does (nonzero dropout, an auxiliary loss, fp16 loss scaling).
"""

from __future__ import annotations

from dataclasses import dataclass

from miles_host.config_fields import flag, optional_int

_ARCH = "megatron-model"
_PERF = "megatron-perf"
_CHECKED = "; checked against --hf-checkpoint's config.json"


@dataclass
class MegatronModelArgs:
    """Megatron's architecture flags (slime's ``MODEL_ARGS``)."""

    num_layers: int | None = flag(None, "decoder layers" + _CHECKED, type=optional_int, group=_ARCH)
    hidden_size: int | None = flag(None, "hidden size" + _CHECKED, type=optional_int, group=_ARCH)
    ffn_hidden_size: int | None = flag(None, "dense MLP intermediate size" + _CHECKED, type=optional_int, group=_ARCH)
    num_attention_heads: int | None = flag(None, "attention heads" + _CHECKED, type=optional_int, group=_ARCH)
    group_query_attention: bool = flag(False, "grouped-query attention (--num-query-groups KV heads)" + _CHECKED, group=_ARCH)
    num_query_groups: int | None = flag(None, "KV heads with --group-query-attention" + _CHECKED, type=optional_int, group=_ARCH)
    kv_channels: int | None = flag(None, "head dim" + _CHECKED, type=optional_int, group=_ARCH)
    normalization: str = flag("LayerNorm", "LayerNorm or RMSNorm (miles builds RMSNorm models)" + _CHECKED, type=str, choices=["LayerNorm", "RMSNorm"], group=_ARCH)
    norm_epsilon: float = flag(1e-5, "norm epsilon" + _CHECKED, type=float, group=_ARCH)
    apply_layernorm_1p: bool = flag(False, "norms scale by (1 + w)" + _CHECKED, group=_ARCH)
    swiglu: bool = flag(False, "gated SiLU MLP" + _CHECKED, group=_ARCH)
    disable_bias_linear: bool = flag(False, "no linear biases" + _CHECKED, group=_ARCH)
    add_qkv_bias: bool = flag(False, "q/k/v biases with --disable-bias-linear" + _CHECKED, group=_ARCH)
    qk_layernorm: bool = flag(False, "per-head q/k norm (MLA: the q/kv low-rank norms)" + _CHECKED, group=_ARCH)
    post_self_attn_layernorm: bool = flag(False, "norm after attention (GLM-4 sandwich norms)" + _CHECKED, group=_ARCH)
    post_mlp_layernorm: bool = flag(False, "norm after the MLP (GLM-4 sandwich norms)" + _CHECKED, group=_ARCH)
    untie_embeddings_and_output_weights: bool = flag(False, "separate output head" + _CHECKED, group=_ARCH)
    vocab_size: int | None = flag(None, "vocabulary size" + _CHECKED, type=optional_int, group=_ARCH)
    make_vocab_size_divisible_by: int = flag(128, "Megatron pads its embedding to a multiple of this; miles keeps the checkpoint's vocabulary (with --train-backend megatron padded per tensor-parallel rank)", type=int, group=_ARCH)
    max_position_embeddings: int | None = flag(None, "longest position" + _CHECKED + " (max_position_embeddings)", type=optional_int, group=_ARCH)
    seq_length: int | None = flag(None, "Megatron's training sequence length; miles packs variable-length samples (--max-tokens-per-gpu bounds a micro-batch)", type=optional_int, group=_ARCH)
    position_embedding_type: str = flag("learned_absolute", "rope, yarn, learned_absolute, mrope, none (miles builds rope models)" + _CHECKED, type=str, choices=["learned_absolute", "rope", "mrope", "yarn", "relative", "none"], group=_ARCH)
    use_rotary_position_embeddings: bool = flag(False, "rotary position embeddings (= --position-embedding-type rope)", group=_ARCH)
    no_position_embedding: bool = flag(False, "no absolute position embedding (rope models have none)", group=_ARCH)
    rotary_base: int = flag(10000, "rope theta" + _CHECKED, type=int, group=_ARCH)
    rotary_percent: float = flag(1.0, "fraction of each head rotated" + _CHECKED, type=float, group=_ARCH)
    rotary_interleaved: bool = flag(False, "rotate interleaved pairs" + _CHECKED, group=_ARCH)
    rope_type: str | None = flag(None, "rope or yarn (Megatron: MLA defaults to yarn, other attention to rope)" + _CHECKED, type=str, choices=["rope", "yarn"], group=_ARCH)
    original_max_position_embeddings: int | None = flag(None, "yarn: the context the rope was trained for" + _CHECKED, type=optional_int, aliases=["--yarn-original-max-position-embeddings"], group=_ARCH)
    beta_fast: float | None = flag(None, "yarn beta_fast" + _CHECKED, type=float, aliases=["--yarn-beta-fast"], group=_ARCH)
    beta_slow: float | None = flag(None, "yarn beta_slow" + _CHECKED, type=float, aliases=["--yarn-beta-slow"], group=_ARCH)
    use_rope_scaling: bool = flag(False, "Llama-3 rope scaling" + _CHECKED, group=_ARCH)
    rotary_scaling_factor: float = flag(1.0, "rope scaling factor (yarn, Llama-3)" + _CHECKED, type=float, group=_ARCH)
    mscale: float = flag(1.0, "yarn mscale" + _CHECKED, type=float, group=_ARCH)
    mscale_all_dim: float = flag(0.0, "yarn mscale_all_dim" + _CHECKED, type=float, group=_ARCH)
    multi_latent_attention: bool = flag(False, "DeepSeek multi-head latent attention" + _CHECKED, group=_ARCH)
    q_lora_rank: int | None = flag(None, "MLA query low rank" + _CHECKED, type=optional_int, group=_ARCH)
    kv_lora_rank: int = flag(32, "MLA key/value low rank" + _CHECKED, type=int, group=_ARCH)
    qk_head_dim: int = flag(128, "MLA q/k head dim without the rotary part (qk_nope_head_dim)" + _CHECKED, type=int, group=_ARCH)
    qk_pos_emb_head_dim: int = flag(64, "MLA rotary q/k head dim (qk_rope_head_dim)" + _CHECKED, type=int, group=_ARCH)
    v_head_dim: int = flag(128, "MLA value head dim" + _CHECKED, type=int, group=_ARCH)
    window_size: str | None = flag(None, "sliding-window attention: LEFT,RIGHT (e.g. 128,0)" + _CHECKED + " (sliding_window)", type=str, group=_ARCH)
    window_attn_skip_freq: str | None = flag(None, "which layers are full attention with --window-size: N (every Nth layer) or a list, 1 = window" + _CHECKED + " (layer_types)", type=str, group=_ARCH)
    use_gated_attention: bool = flag(False, "gated attention (Qwen3-Next, Qwen3.5): not a model miles builds", group=_ARCH)
    attention_output_gate: bool = flag(False, "attention output gate (Qwen3-Next, Qwen3.5): not a model miles builds", group=_ARCH)
    softmax_type: str = flag("vanilla", "attention softmax: vanilla, off-by-one, learnable (attention sinks: not a model miles builds)", type=str, choices=["vanilla", "off-by-one", "learnable"], group=_ARCH)
    moe_latent_size: int | None = flag(None, "MoE latent projection size (Nemotron-3: not a model miles builds)", type=optional_int, group=_ARCH)
    custom_model_provider_path: str | None = flag(None, "upstream miles: a custom Megatron model provider (miles builds the model from --hf-checkpoint through its family adapter: not supported)", type=str, group=_ARCH)
    spec: list[str] | None = flag(None, "Megatron layer spec: MODULE FUNCTION (the specs of slime's scripts; each names the models it builds)", type=str, nargs="*", group=_ARCH)
    num_experts: int | None = flag(None, "routed experts" + _CHECKED, type=optional_int, group=_ARCH)
    moe_router_topk: int = flag(2, "experts per token" + _CHECKED, type=int, group=_ARCH)
    moe_ffn_hidden_size: int | None = flag(None, "expert intermediate size" + _CHECKED, type=optional_int, group=_ARCH)
    moe_shared_expert_intermediate_size: int | None = flag(None, "intermediate size of all shared experts together" + _CHECKED, type=optional_int, group=_ARCH)
    moe_shared_expert_gate: bool = flag(False, "sigmoid gate on the shared expert (Qwen2-MoE)" + _CHECKED, group=_ARCH)
    moe_layer_freq: str = flag("1", "which layers are MoE: N (every Nth) or a list such as [0]*1+[1]*45" + _CHECKED, type=str, group=_ARCH)
    moe_router_score_function: str = flag("softmax", "router scores" + _CHECKED, type=str, choices=["softmax", "sigmoid"], group=_ARCH)
    moe_router_pre_softmax: bool = flag(False, "softmax router: scores over all experts, not renormalised over the top-k (norm_topk_prob false)" + _CHECKED, group=_ARCH)
    moe_router_enable_expert_bias: bool = flag(False, "expert-score bias used for the choice only (e_score_correction_bias)" + _CHECKED, group=_ARCH)
    moe_router_topk_scaling_factor: float | None = flag(None, "routed weights scale (routed_scaling_factor)" + _CHECKED, type=float, group=_ARCH)
    moe_router_num_groups: int | None = flag(None, "expert groups of group-limited routing (n_group)" + _CHECKED, type=optional_int, group=_ARCH)
    moe_router_group_topk: int | None = flag(None, "groups chosen per token (topk_group)" + _CHECKED, type=optional_int, group=_ARCH)


@dataclass
class MegatronTrainingArgs:
    """Megatron's performance, precision and MoE-training flags (slime's ``PERF_ARGS``)."""

    attention_dropout: float = flag(0.0, "attention dropout: miles trains without dropout, so only 0 is accepted (Megatron's default is 0.1; slime scripts pass 0.0)", type=float, group=_PERF)
    hidden_dropout: float = flag(0.0, "hidden dropout: miles trains without dropout, so only 0 is accepted (Megatron's default is 0.1; slime scripts pass 0.0)", type=float, group=_PERF)
    attention_softmax_in_fp32: bool = flag(False, "attention softmax in float32 (miles' attention always accumulates its softmax in float32; with --train-backend megatron passed to TransformerConfig)", group=_PERF)
    accumulate_allreduce_grads_in_fp32: bool = flag(False, "reduce gradients in float32 (miles' gradients are float32: always on)", group=_PERF)
    attention_backend: str = flag("auto", "Megatron's attention kernel choice (flash, fused, unfused, local, auto)", type=str, choices=["flash", "fused", "unfused", "local", "auto"], group=_PERF)
    transformer_impl: str = flag("transformer_engine", "Megatron's layer implementation (local, transformer_engine, inference_optimized)", type=str, choices=["local", "transformer_engine", "inference_optimized"], group=_PERF)
    bf16: bool = flag(False, "Megatron bf16 training (miles: --dtype; auto is bf16 autocast over float32 masters on GPU)", group=_PERF)
    fp16: bool = flag(False, "Megatron fp16 training with loss scaling: not supported (use bf16)", group=_PERF)
    expert_tensor_parallel_size: int = flag(1, "tensor parallelism inside experts (only 1: experts are never TP-split)", type=int, group="parallel")
    decoder_first_pipeline_num_layers: int | None = flag(None, "decoder layers of the first pipeline stage (uneven pipelines)", type=optional_int, group="parallel")
    decoder_last_pipeline_num_layers: int | None = flag(None, "decoder layers of the last pipeline stage (uneven pipelines)", type=optional_int, group="parallel")
    use_distributed_optimizer: bool = flag(False, "Megatron's ZeRO-1 distributed optimizer (--train-backend megatron: Megatron-Core's optimizer, its state sharded over the data-parallel ranks, clipping by Megatron; the native trainers shard with FSDP2)", group=_PERF)
    use_precision_aware_optimizer: bool = flag(False, "Megatron's precision-aware optimizer (optimizer states in lower precision)", group=_PERF)
    overlap_cpu_optimizer_d2h_h2d: bool = flag(False, "overlap the CPU optimizer's device<->host copies", group=_PERF)
    overlap_grad_reduce: bool = flag(False, "overlap data-parallel gradient reduction with backward (--train-backend megatron: Megatron's DDP reduces bucket by bucket; the native trainers reduce with FSDP2/DDP as they do)", group=_PERF)
    overlap_param_gather: bool = flag(False, "overlap the distributed optimizer's parameter all-gather with forward", group=_PERF)
    no_gradient_accumulation_fusion: bool = flag(False, "Megatron: no fused weight-gradient accumulation (miles never fuses it)", group=_PERF)
    no_masked_softmax_fusion: bool = flag(False, "Megatron: no fused masked softmax (miles never fuses it)", group=_PERF)
    no_rope_fusion: bool = flag(False, "Megatron: no fused rope (miles never fuses it)", group=_PERF)
    cross_entropy_loss_fusion: bool = flag(False, "Megatron's fused cross entropy (miles computes log-probs in chunks instead)", group=_PERF)
    no_bias_swiglu_fusion: bool = flag(False, "Megatron: no fused bias + SwiGLU (miles never fuses it)", group=_PERF)
    no_bias_dropout_fusion: bool = flag(False, "Megatron: no fused bias + dropout + add (miles never fuses it)", group=_PERF)
    grad_reduce_in_bf16: bool = flag(False, "Megatron: reduce gradients in bf16 (miles reduces float32 gradients)", group=_PERF)
    use_flash_attn: bool = flag(False, "Megatron's older switch for flash attention (see --attention-backend)", group=_PERF)
    qkv_format: str = flag("thd", "upstream miles: attention input layout, thd (packed) or bshd (padded)", type=str, choices=["thd", "bshd"], group=_PERF)
    no_check_for_nan_in_loss_and_grad: bool = flag(False, "Megatron: skip its NaN check (miles counts NaN steps: --max-consecutive-nan-steps)", group=_PERF)
    moe_grouped_gemm: bool = flag(False, "experts as one grouped GEMM (miles: --moe-kernel in the engine, grouped GEMM in training where fast)", group=_PERF)
    moe_permute_fusion: bool = flag(False, "TransformerEngine's fused token permutation", group=_PERF)
    moe_router_dtype: str | None = flag(None, "router GEMM dtype: fp32, fp64 (miles' native model: the family's, fp32 for DeepSeek/GLM; with --train-backend megatron passed to TransformerConfig)", type=str, choices=["fp32", "fp64"], group=_PERF)
    moe_token_dispatcher_type: str = flag("allgather", "expert token dispatcher: allgather, alltoall, flex (with --train-backend megatron passed to TransformerConfig on GPU)", type=str, choices=["allgather", "alltoall", "flex"], group=_PERF)
    moe_enable_deepep: bool = flag(False, "DeepEP token dispatch (needs --moe-token-dispatcher-type flex)", group=_PERF)
    moe_token_drop_policy: str = flag("probs", "which tokens an expert over capacity drops (miles has no capacity limit: none dropped)", type=str, choices=["probs", "position"], group=_PERF)
    moe_router_load_balancing_type: str = flag("aux_loss", "load-balancing loss kind (with --moe-aux-loss-coeff 0, the only value miles trains with, none is added)", type=str, choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"], group=_PERF)
    moe_aux_loss_coeff: float = flag(0.0, "load-balancing loss weight: miles adds none, so only 0 is accepted (slime's MoE scripts pass 0)", type=float, group=_PERF)
    moe_router_bias_update_rate: float = flag(1e-3, "rate of the expert-bias update: miles keeps the checkpoint's expert bias fixed, as rate 0 does (slime's scripts pass 0)", type=float, group=_PERF)
    enable_experimental: bool = flag(False, "Megatron's experimental features (none is used by miles)", group=_PERF)
    allgather_cp: bool = flag(False, "slime: context parallelism by all-gather (the megatron backend's context parallelism always all-gathers keys and values)", group="parallel")
    cp_comm_type: list[str] = flag(["p2p"], "Megatron: context-parallel attention communication (p2p, a2a, allgather, a2a+p2p; per layer when several)", type=str, nargs="+", group="parallel")


@dataclass
class MegatronArgs(MegatronTrainingArgs, MegatronModelArgs):
    """Every Megatron flag of this module (one base of :class:`miles_host.config.MilesConfig`)."""


#: flags ``--train-backend megatron`` passes to Megatron-Core's ``TransformerConfig`` (miles field ->
#: TransformerConfig field); for other backends they are accepted and ignored
MEGATRON_BACKEND_FIELDS: dict[str, str] = {
    "attention_softmax_in_fp32": "attention_softmax_in_fp32",
    "moe_router_dtype": "moe_router_dtype",
    "moe_token_dispatcher_type": "moe_token_dispatcher_type",
}

_TE = "needs TransformerEngine, which no backend of miles uses"

#: what --train-backend megatron's context parallelism does whatever its communication flags say
_CP_ALL_GATHER = ("--train-backend megatron's context-parallel attention (the local layer spec's, "
                  "miles_megatron.context_parallel) all-gathers the keys and values of the CP group, "
                  "TransformerEngine's all_gather variant: the same attention as p2p / a2a")

#: Megatron flags accepted and ignored (merged into
#: :data:`miles_host.validation.ignored_flags.ACCEPTED_AND_IGNORED`): field -> what miles does instead
MEGATRON_IGNORED: dict[str, str] = {
    "attention_backend": "the native model picks its attention kernel (SDPA / flash); --train-backend megatron "
                         "runs Megatron-Core's local (non-TransformerEngine) attention",
    "transformer_impl": "the native trainers build miles' own layers; --train-backend megatron builds "
                        "Megatron-Core's local layer spec (no TransformerEngine)",
    "bf16": "the precision is --dtype (auto: bf16 autocast over float32 master weights on GPU, float32 on CPU)",
    "use_distributed_optimizer": "optimizer state is sharded by FSDP2 across the native trainer's GPUs; "
                                 "--train-backend megatron honours it (Megatron-Core's distributed optimizer)",
    "use_precision_aware_optimizer": "optimizer states stay float32 (AdamW over float32 master weights)",
    "overlap_cpu_optimizer_d2h_h2d": "no Megatron CPU optimizer runs (see --optimizer-cpu-offload)",
    "overlap_param_gather": "parameters are gathered by FSDP2 (native); the megatron backend's distributed "
                            "optimizer gathers them after its step (not overlapped with the next forward)",
    "cross_entropy_loss_fusion": "log-probs are computed in chunks from the hidden states (no fused cross entropy)",
    "no_check_for_nan_in_loss_and_grad": "miles checks every step: a NaN/Inf step is skipped, and "
                                         "--max-consecutive-nan-steps stops the run",
    "moe_grouped_gemm": "the routed experts of both trainers run grouped GEMMs where they are fast (CUDA bf16; "
                        "MoEConfig.experts_impl; the engine's: --moe-kernel), the per-expert loop elsewhere",
    "moe_permute_fusion": f"the fused token permutation {_TE}",
    "moe_router_dtype": "the native model computes the router in its family's dtype (float32 for DeepSeek and "
                        "GLM, the model's for Qwen); --train-backend megatron passes it to TransformerConfig",
    "moe_token_dispatcher_type": "the native trainer runs each token's experts on its own rank (no token "
                                 "dispatch); --train-backend megatron passes it to TransformerConfig",
    "moe_enable_deepep": "no DeepEP dispatch (the native trainer dispatches no tokens, the megatron backend "
                         "uses allgather or alltoall)",
    "moe_token_drop_policy": "experts have no capacity limit: no token is dropped",
    "make_vocab_size_divisible_by": "the embedding keeps the checkpoint's vocabulary (the megatron backend pads "
                                    "it per tensor-parallel rank itself)",
    "enable_experimental": "no Megatron experimental feature is used",
    "allgather_cp": _CP_ALL_GATHER,
    "cp_comm_type": _CP_ALL_GATHER,
    "grad_reduce_in_bf16": "gradients are float32 and reduced in float32",
    "use_flash_attn": "the native model picks its attention kernel (SDPA / flash); the megatron backend runs "
                      "Megatron-Core's local attention",
    "qkv_format": "miles packs each micro-batch's samples into one sequence (thd) on every backend",
    "seq_length": "samples are packed at their own lengths (--max-tokens-per-gpu bounds a micro-batch)",
}

#: Megatron flags whose accepted values are what miles does anyway: accepted without a warning
MATCHES_MILES: dict[str, str] = {
    "attention_softmax_in_fp32": "miles' attention accumulates its softmax in float32",
    "accumulate_allreduce_grads_in_fp32": "gradients are float32 (float32 master weights)",
    "no_gradient_accumulation_fusion": "miles never fuses the weight-gradient accumulation",
    "no_masked_softmax_fusion": "miles never fuses the masked softmax",
    "no_rope_fusion": "miles never fuses the rotary embedding",
    "no_bias_swiglu_fusion": "miles never fuses bias and SwiGLU",
    "no_bias_dropout_fusion": "miles never fuses bias, dropout and the residual add",
    "no_position_embedding": "the models miles builds use rotary embeddings and no absolute position embedding",
    "moe_router_load_balancing_type": "no load-balancing loss is added (--moe-aux-loss-coeff must be 0)",
}
