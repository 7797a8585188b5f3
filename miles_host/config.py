"""The run configuration: one flat dataclass, declared in groups.

Field names are slime's argument names, so ``config.rollout_batch_size`` reads as
``args.rollout_batch_size`` does in slime, and every field is a ``miles run`` flag
(``--rollout-batch-size``). Plugin flags land in ``config.plugin_args`` and read as
attributes too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from miles_host.config_fields import flag, flag_name, optional_int, size_in_bytes
from miles_host.config_kernels import switch_flag
from miles_host.config_ckpt import CheckpointFormatArgs
from miles_host.config_dashboard import ObservabilityArgs, check_dashboard
from miles_host.config_eval_rewards import EvalRewardArgs, check_eval_rewards
from miles_host.config_lora import LoraArgs
from miles_host.config_megatron import MegatronArgs
from miles_host.config_opd import OpdArgs
from miles_host.config_pipeline import VirtualPipelineArgs
from miles_host.config_optim_logging import OptimLoggingArgs, check_optim_logging
from miles_host.config_sglang import SGLangRouterArgs, SGLangServerArgs, check_sglang_args
from miles_host.config_training_modes import TrainingModeArgs, check_training_modes
from miles_host.config_fault_tolerance import FaultToleranceArgs, check_fault_tolerance


@dataclass
class ClusterArgs:
    actor_num_nodes: int = flag(1, "nodes for training workers", type=int, group="cluster")
    actor_num_gpus_per_node: int = flag(1, "GPUs per node for training", type=int, group="cluster")
    rollout_num_gpus: int | None = flag(None, "GPUs for rollout engines, --rollout-num-gpus-per-engine each (with --colocate: default one per trainer GPU; must divide their number)", type=optional_int, group="cluster")
    rollout_num_gpus_per_engine: int = flag(1, "GPUs per rollout engine: the tensor parallel size of each SGLang server --rollout-backend sglang launches (real SGLang); the embedded engine and miles serve take 1", type=int, group="cluster")
    num_gpus_per_node: int = flag(8, "slime compatibility: accepted and ignored (placement comes from --actor-num-gpus-per-node and --rollout-num-gpus)", type=int, group="cluster")
    colocate: bool = flag(False, "training and rollout share GPUs (engine i on trainer i's GPU); the engines free their KV cache and CUDA graphs while training", group="cluster")
    offload_train: bool = flag(False, "move the trainer's parameters, gradients and optimizer state to CPU during rollout", group="cluster")
    offload_rollout: bool = flag(False, "free the rollout engines' KV cache and move their weights to CPU during training", group="cluster")
    device: str = flag("auto", "device for the embedded engine and trainer: auto, cpu, cuda", type=str, group="cluster")
    use_ray: bool = flag(False, "place trainer and rollout workers as Ray actors (a local cluster, or RAY_ADDRESS); implied by --actor-num-nodes > 1", group="cluster")
    worker_timeout: float = flag(120.0, "seconds a worker process may stay silent before the run stops (multi-process runs)", type=float, group="cluster")


@dataclass
class CheckpointArgs:
    hf_checkpoint: str | None = flag(None, "HF-format model directory (policy init, tokenizer)", type=str, group="checkpoint")
    model_name: str | None = flag(None, "slime compatibility: accepted and ignored (recorded in config.json)", type=str, group="checkpoint")
    ref_load: str | None = flag(None, "reference model checkpoint (default: --hf-checkpoint)", type=str, group="checkpoint")
    load: str | None = flag(None, "resume from this checkpoint directory", type=str, group="checkpoint")
    save: str | None = flag(None, "save checkpoints to this directory", type=str, group="checkpoint")
    save_interval: int | None = flag(None, "save every N rollouts", type=optional_int, group="checkpoint")
    save_hf: str | None = flag(None, "also save HF-format weights here ({rollout_id} is substituted)", type=str, group="checkpoint")
    dtype: str = flag("auto", "parameter dtype: auto (bf16 on GPU, float32 on CPU), float32, bfloat16", type=str, choices=["auto", "float32", "bfloat16", "float16"], group="checkpoint")
    seed: int = flag(1234, "random seed", type=int, group="checkpoint")


@dataclass
class DataArgs:
    prompt_data: str | None = flag(None, "prompts: .jsonl or .parquet", type=str, group="data")
    input_key: str = flag("input", "key of the prompt in each record", type=str, group="data")
    label_key: str | None = flag(None, "key of the label in each record", type=str, group="data")
    metadata_key: str = flag("metadata", "key of per-sample metadata in each record", type=str, group="data")
    tool_key: str | None = flag(None, "key of tool definitions in each record (a list of OpenAI tool records, or its JSON string): put in sample.metadata['tools'] and, with --apply-chat-template, given to the chat template", type=str, group="data")
    apply_chat_template: bool = flag(False, "wrap prompts with the tokenizer's chat template", group="data")
    rollout_shuffle: bool = flag(False, "shuffle prompts each epoch", group="data")
    rollout_seed: int = flag(42, "seed of prompt shuffling and rollout sampling", type=int, group="data")
    num_rollout: int | None = flag(None, "number of rollout steps", type=optional_int, group="data")
    num_epoch: int | None = flag(None, "epochs over the prompts (sets --num-rollout)", type=optional_int, group="data")
    rollout_max_prompt_len: int | None = flag(None, "drop prompts longer than this many tokens", type=optional_int, group="data")


@dataclass
class RolloutArgs:
    rollout_backend: str = flag("embedded", "rollout backend (registry: miles plugins)", type=str, group="rollout")
    rollout_batch_size: int = flag(8, "prompts per rollout step", type=int, group="rollout")
    n_samples_per_prompt: int = flag(1, "samples per prompt", type=int, group="rollout")
    rollout_temperature: float = flag(1.0, "sampling temperature", type=float, group="rollout")
    rollout_top_p: float = flag(1.0, "top-p", type=float, group="rollout")
    rollout_top_k: int = flag(-1, "top-k (-1: off)", type=int, group="rollout")
    rollout_max_response_len: int = flag(1024, "max new tokens per sample", type=int, group="rollout")
    rollout_max_context_len: int | None = flag(None, "max prompt+response tokens", type=optional_int, group="rollout")
    rollout_stop: list[str] | None = flag(None, "stop strings", type=str, nargs="*", group="rollout")
    rollout_stop_token_ids: list[int] | None = flag(None, "stop token ids", type=int, nargs="*", group="rollout")
    over_sampling_batch_size: int | None = flag(None, "prompts submitted at once when dynamic sampling filters groups", type=optional_int, group="rollout")
    dynamic_sampling_filter_path: str | None = flag(None, "module.fn deciding whether a group is kept", type=str, group="rollout")
    partial_rollout: bool = flag(False, "abort unfinished samples once the batch is full and continue them next step", group="rollout")
    mask_offpolicy_in_partial_rollout: bool = flag(False, "mask tokens produced by an older policy in continued samples", group="rollout")
    max_failed_sample_fraction: float = flag(0.5, "stop the run after a rollout in which more than this fraction of the samples failed (reward errors, prompts too long, ...), with the first failure's message; 1: never", type=float, group="rollout")
    custom_generate_function_path: str | None = flag(None, "module.fn replacing per-sample generation (multi-turn, tools): fn(args, sample, sampling_params, session), sync or async; trajectories run concurrently", type=str, group="rollout")
    use_session_server: bool = flag(False, "give each trajectory of the --custom-generate-function-path function an OpenAI base URL (session.base_url, sample.metadata['session_url']) whose chat requests are recorded token-in-token-out into its sample", group="rollout")
    session_server_port: int = flag(0, "port of the loopback session server (0: any free port)", type=int, group="rollout")
    session_prefix_mismatch: str = flag("error", "a session turn whose rendered prompt does not start with the recorded tokens: error (the sample fails, naming the turn), retokenize (the rest taken from the new rendering, not trained), drop (the sample is not trained)", type=str, choices=["error", "retokenize", "drop"], group="rollout")
    sglang_server_concurrency: int = flag(512, "at most this many trajectories of a --custom-generate-function-path function at once (requests in flight to the rollout engine)", type=int, group="rollout")
    sglang_mem_fraction_static: float | None = flag(None, "GPU memory fraction for the engine's weights + KV cache", type=float, group="rollout")
    sglang_disable_overlap_schedule: bool = flag(False, "read each decode step's tokens before launching the next (SGLang's --disable-overlap-schedule; by default on CUDA step N+1 is launched before step N's tokens are read)", group="rollout")
    rollout_max_num_seqs: int | None = flag(None, "max concurrent sequences in the embedded engine", type=optional_int, group="rollout")
    moe_kernel: str = flag("fused", "routed experts in the embedded engine: fused (one routing launch, one grouped GEMM per projection, one combine) or loop (one expert at a time)", type=str, choices=["fused", "loop"], group="rollout")
    rollout_return_routed_experts: bool = flag(False, "ask the engine for the MoE experts of every token (set by routing-replay plugins)", group="rollout")
    true_on_policy: bool = flag(False, "batch-invariant kernels: rollout and training logprobs bitwise equal", aliases=["--true-on-policy-mode"], group="rollout")


@dataclass
class AsyncArgs:
    fully_async: bool = flag(False, "rollout keeps generating while the trainer trains: finished groups wait in a buffer, the trainer takes each batch from it, weights are pushed every --update-weights-interval steps (python train_async.py runs this)", group="async")
    update_weights_interval: int = flag(1, "push the trainer's weights to the engines every N training steps", type=int, group="async")
    max_weight_staleness: int | None = flag(None, "--fully-async: a group whose oldest token was generated more than N weight versions (training steps) before the step that would train it is not trained (see --async-unused-samples-handler); none: no bound", type=optional_int, group="async")
    async_max_concurrent_samples: int | None = flag(None, "--fully-async: at most this many samples generating at once (default: one batch, --rollout-batch-size x --n-samples-per-prompt)", type=optional_int, group="async")
    async_data_buffer_capacity_factor: float = flag(2.0, "--fully-async: finished groups waiting for the trainer, at most floor(factor x --rollout-batch-size); a full buffer stops new groups from starting", type=float, group="async")
    async_unused_samples_handler: str = flag("drop", "--fully-async: a finished group the trainer does not take (beyond --max-weight-staleness, or aborted by --pause-generation-mode abort): drop (counted) or retry (its prompt is generated again)", type=str, choices=["drop", "retry"], group="async")
    pause_generation_mode: str | None = flag(None, "--fully-async, at a weight update: in_place (requests keep their KV cache and continue with the new weights; each token keeps the version that made it), retract (requests stop with their tokens and continue after the update, prefilled again), abort (requests stop and their groups go to --async-unused-samples-handler); default retract, in_place with --custom-generate-function-path", type=str, choices=["abort", "retract", "in_place"], group="async")


@dataclass
class SpeculativeArgs:
    sglang_speculative_algorithm: str | None = flag(None, "speculative decoding algorithm (EAGLE, ...)", type=str, group="speculative")
    sglang_speculative_num_steps: int | None = flag(None, "draft steps per verify", type=optional_int, group="speculative")
    sglang_speculative_eagle_topk: int | None = flag(None, "draft branching (1 supported)", type=optional_int, group="speculative")
    sglang_speculative_num_draft_tokens: int | None = flag(None, "draft tokens verified per step", type=optional_int, group="speculative")
    sglang_speculative_draft_model_path: str | None = flag(None, "separate draft model", type=str, group="speculative")
    sglang_speculative_token_map: str | None = flag(
        None, "FR-Spec: the draft proposes only these token ids (a torch.save'd 1-D tensor, or a JSON list)",
        type=str, group="speculative")
    sglang_enable_draft_weights_cpu_backup: bool = flag(False, "keep a CPU copy of draft weights", group="speculative")
    mtp_num_layers: int | None = flag(None, "MTP (draft) layers", type=optional_int, group="speculative")
    enable_mtp_training: bool = flag(False, "train the MTP draft online on rollouts", group="speculative")
    mtp_loss_scaling_factor: float = flag(0.2, "weight of the MTP loss", type=float, group="speculative")


@dataclass
class RewardArgs:
    rm_type: str | None = flag(None, "built-in reward (registry: miles plugins)", type=str, group="reward")
    custom_rm_path: str | None = flag(None, "module.fn reward (sync or async)", type=str, group="reward")
    group_rm: bool = flag(False, "the reward function scores a whole group at once", group="reward")
    rm_url: str | None = flag(None, "remote reward: HTTP POST endpoint", type=str, group="reward")
    rm_timeout: float = flag(30.0, "seconds a reward may take: per HTTP attempt of --rm-url, per call (per group with --group-rm) of a custom or built-in reward, whose sample then fails", type=float, group="reward")
    rm_max_retries: int = flag(3, "remote reward retries", type=int, group="reward")
    reward_key: str | None = flag(None, "key of the reward when the reward is a dict", type=str, group="reward")


@dataclass
class AlgorithmArgs:
    advantage_estimator: str = flag("grpo", "advantage estimator (registry: miles plugins)", type=str, group="algorithm")
    disable_grpo_std_normalization: bool = flag(False, "Dr.GRPO: no std normalisation", group="algorithm")
    disable_rewards_normalization: bool = flag(False, "grpo, gspo, cispo, reinforce_plus_plus_baseline: use the raw reward (no group mean subtracted, no std division)", group="algorithm")
    normalize_advantages: bool = flag(False, "whiten advantages over the batch", group="algorithm")
    gamma: float = flag(1.0, "discount (ppo, reinforce++)", type=float, group="algorithm")
    lambd: float = flag(1.0, "GAE lambda (ppo)", type=float, group="algorithm")
    eps_clip: float = flag(0.2, "PPO clip range", type=float, group="algorithm")
    eps_clip_high: float | None = flag(None, "upper PPO clip (default: --eps-clip)", type=float, group="algorithm")
    eps_clip_c: float | None = flag(None, "dual-clip constant", type=float, group="algorithm")
    use_kl_loss: bool = flag(False, "KL loss against the reference model", group="algorithm")
    kl_loss_coef: float = flag(0.0, "KL loss weight", type=float, group="algorithm")
    kl_loss_type: str = flag("k1", "KL estimator of the KL loss and of the KL reward shaping (--kl-coef)", type=str, choices=["k1", "k2", "k3", "low_var_kl"], group="algorithm")
    use_unbiased_kl: bool = flag(False, "weight the KL loss per token by pi/pi_old (DeepSeek-V3.2's unbiased KL estimate)", group="algorithm")
    kl_coef: float = flag(0.0, "KL reward shaping weight", type=float, group="algorithm")
    critic_load: str | None = flag(None, "PPO critic initial weights (default: --hf-checkpoint)", type=str, group="algorithm")
    critic_lr: float | None = flag(None, "PPO critic learning rate (default: --lr)", type=float, group="algorithm")
    value_clip: float | None = flag(0.2, "PPO value clipping range (none: unclipped)", type=lambda t: None if t.lower() == "none" else float(t), group="algorithm")
    entropy_coef: float = flag(0.0, "entropy bonus weight", type=float, group="algorithm")
    calculate_per_token_loss: bool = flag(False, "token-level loss aggregation (default: per-sequence mean); --loss-agg-mode token-mean", group="algorithm")
    loss_agg_mode: str | None = flag(None, "loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum, token-sum (default: token-mean with --calculate-per-token-loss, else seq-mean-token-mean)", type=str, choices=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"], group="algorithm")
    use_rollout_logprobs: bool = flag(False, "use the rollout's logprobs as the old policy", group="algorithm")
    old_logprob_pass: str = flag(
        "auto", "recompute the old policy's log-probs before training: always, or auto (skipped when the rollout "
        "is one optimizer step and nothing needs them first: the old policy is then the current one)",
        type=str, choices=["auto", "always"], group="algorithm",
    )
    use_tis: bool = flag(False, "truncated importance sampling", group="correction")
    tis_clip: float = flag(2.0, "TIS upper clip", type=float, aliases=["--tis-threshold"], group="correction")
    tis_clip_low: float = flag(0.0, "TIS lower clip", type=float, group="correction")
    use_mis: bool = flag(False, "masked importance sampling", group="correction")
    mis_level: str = flag("token", "MIS level", type=str, choices=["token", "sequence", "geometric"], group="correction")
    mis_mode: str = flag("truncate", "MIS mode: truncate (weight capped at the upper bound), clip (weight clamped to [lower, upper]), mask (tokens outside [lower, upper] masked)", type=str, choices=["truncate", "clip", "mask"], group="correction")
    mis_upper_bound: float = flag(2.0, "MIS upper bound", type=float, group="correction")
    mis_lower_bound: float = flag(0.5, "MIS lower bound (clip and mask modes)", type=float, group="correction")
    mis_veto_threshold: float | None = flag(None, "mask a sequence if any token ratio is below this", type=float, group="correction")
    use_icepop: bool = flag(False, "icepop: mask tokens whose ratio leaves [--tis-clip-low, --tis-clip]", group="correction")


@dataclass
class TrainArgs:
    train_backend: str = flag("native", "training backend (registry: miles plugins)", type=str, group="train")
    precision: str = flag("bf16", "linear-weight precision recipe (registry: miles plugins)", type=str, group="train")
    num_steps_per_rollout: int | None = flag(None, "optimizer steps per rollout", type=optional_int, group="train")
    global_batch_size: int | None = flag(None, "samples per optimizer step", type=optional_int, group="train")
    micro_batch_size: int = flag(1, "samples per forward", type=int, group="train")
    use_dynamic_batch_size: bool = flag(False, "pack micro-batches by tokens", group="train")
    max_tokens_per_gpu: int | None = flag(None, "token budget of a packed micro-batch", type=optional_int, group="train")
    lr: float = flag(1e-6, "learning rate", type=float, group="train")
    min_lr: float = flag(0.0, "final learning rate of the decay", type=float, group="train")
    lr_decay_style: str = flag("constant", "constant, linear, cosine", type=str, choices=["constant", "linear", "cosine"], group="train")
    lr_warmup_iters: int = flag(0, "warm-up optimizer steps", type=int, group="train")
    lr_decay_iters: int | None = flag(None, "decay optimizer steps", type=optional_int, group="train")
    weight_decay: float = flag(0.0, "weight decay of matrices and embeddings (biases and norm weights take none, as in "
                               "Megatron); default 0, unlike Megatron's and slime's 0.01, so runs that never gave it keep "
                               "their numerics (slime's scripts give --weight-decay 0.1 explicitly)", type=float,
                               group="train")
    adam_beta1: float = flag(0.9, "AdamW beta1", type=float, group="train")
    adam_beta2: float = flag(0.98, "AdamW beta2; default 0.98, unlike Megatron's and slime's 0.999: the value every "
                             "slime script gives explicitly", type=float, group="train")
    adam_eps: float = flag(1e-8, "AdamW eps", type=float, group="train")
    clip_grad: float = flag(1.0, "gradient norm clip", type=float, group="train")
    train_compile: bool = flag(False, "torch.compile the trainer's decoder layers (CUDA; dynamic shapes)", group="train")
    recompute_granularity: str | None = flag(None, "activation checkpointing: full (recompute every decoder layer in backward)", type=str, choices=["full"], group="train")
    recompute_method: str | None = flag(None, "activation checkpointing method: uniform (what full recomputation does; Megatron's spelling)", type=str, group="train")
    recompute_num_layers: int | None = flag(None, "decoder layers per activation checkpoint: 1 (what full recomputation does; Megatron's spelling)", type=optional_int, group="train")
    tensor_model_parallel_size: int = flag(1, "tensor parallelism", type=int, group="parallel")
    pipeline_model_parallel_size: int = flag(1, "pipeline parallelism", type=int, group="parallel")
    expert_model_parallel_size: int = flag(1, "expert parallelism", type=int, group="parallel")
    context_parallel_size: int = flag(1, "context parallelism", type=int, group="parallel")
    sequence_parallel: bool = flag(False, "sequence parallelism", group="parallel")
    weight_sync: str = flag("inprocess", "trainer -> rollout transport (registry: miles plugins); with engine processes the default becomes broadcast, or cuda_ipc when colocated on GPUs", type=str, group="train")
    update_weight_buffer_size: int = flag(512 << 20, "bucket size of weight sync", type=size_in_bytes, group="train")
    split_k_reduce: str = switch_flag("split_k_reduce")
    small_m_gemm: str = switch_flag("small_m_gemm")
    pdl: str = switch_flag("pdl")
    sampler_kernel: str = switch_flag("sampler_kernel")
    moe_combine: str = switch_flag("moe_combine")
    moe_gemv_tokens: int = switch_flag("moe_gemv_tokens")
    moe_invariant_decode: str = switch_flag("moe_invariant_decode")
    mla_kv_cache: str = switch_flag("mla_kv_cache")
    mla_prefill: str = switch_flag("mla_prefill")
    max_consecutive_nan_steps: int = flag(3, "stop (with a checkpoint) after this many NaN steps in a row", type=int, group="train")


@dataclass
class EvalArgs:
    eval_interval: int | None = flag(None, "evaluate every N rollouts", type=optional_int, group="eval")
    eval_prompt_data: list[str] | None = flag(None, "name path [name path ...]", type=str, nargs="+", group="eval")
    n_samples_per_eval_prompt: int = flag(1, "samples per eval prompt", type=int, group="eval")
    eval_temperature: float | None = flag(None, "eval temperature (default: rollout's)", type=float, group="eval")
    eval_top_p: float | None = flag(None, "eval top-p", type=float, group="eval")
    eval_max_response_len: int | None = flag(None, "eval max new tokens", type=optional_int, group="eval")


@dataclass
class OutputArgs:
    output_dir: str | None = flag(None, "where metrics, plots and dumps go (default: outputs/<time>)", type=str, group="output")
    use_wandb: bool = flag(False, "log to wandb when installed", group="output")
    wandb_project: str | None = flag(None, "wandb project", type=str, group="output")
    use_tensorboard: bool = flag(False, "log to TensorBoard when installed", group="output")
    dump_rollouts: bool = flag(False, "write each step's samples as JSONL", group="output")
    no_progress: bool = flag(False, "no progress bar", group="output")


#: MilesConfig fields that are not flags
NON_FLAG_FIELDS = ("plugins", "plugin_args", "user_set")


@dataclass
class MilesConfig(
    OutputArgs,
    EvalArgs,
    TrainArgs,
    AlgorithmArgs,
    RewardArgs,
    SpeculativeArgs,
    AsyncArgs,
    RolloutArgs,
    DataArgs,
    CheckpointArgs,
    ClusterArgs,
    TrainingModeArgs,
    MegatronArgs,
    SGLangServerArgs,
    SGLangRouterArgs,
    OptimLoggingArgs,
    EvalRewardArgs,
    OpdArgs,
    LoraArgs,
    CheckpointFormatArgs,
    ObservabilityArgs,
    FaultToleranceArgs,
    VirtualPipelineArgs,
):
    """The resolved configuration of a run (all slime-spelled flags)."""

    plugins: list[str] = field(default_factory=list)
    plugin_args: dict[str, Any] = field(default_factory=dict)
    #: fields the user gave (command line or ``--config`` file), recorded by the CLI; plugins
    #: leave them alone. None for a config built in Python: every non-default field counts.
    user_set: list[str] | None = None

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not fields: plugin flags.
        plugin_args = self.__dict__.get("plugin_args", {})
        if name in plugin_args:
            return plugin_args[name]
        raise AttributeError(f"MilesConfig has no field or plugin flag {name!r}")

    def __post_init__(self) -> None:
        validate_config(self)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of every field (plugin flags under ``plugin_args``)."""
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        """All flag-backed field names."""
        return [f.name for f in dataclasses.fields(cls) if f.name not in NON_FLAG_FIELDS]


def _positive(config: MilesConfig, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")


def validate_config(config: MilesConfig) -> None:
    """Check values a user can get wrong; ValueError naming the flag."""
    _positive(
        config,
        "rollout_batch_size",
        "n_samples_per_prompt",
        "rollout_max_response_len",
        "micro_batch_size",
        "global_batch_size",
        "num_rollout",
        "num_epoch",
        "max_tokens_per_gpu",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "expert_model_parallel_size",
        "actor_num_nodes",
        "actor_num_gpus_per_node",
        "rm_timeout",
        "sglang_server_concurrency",
    )
    if config.rollout_temperature < 0:
        raise ValueError(f"--rollout-temperature must be >= 0, got {config.rollout_temperature}")
    if not 0 < config.rollout_top_p <= 1:
        raise ValueError(f"--rollout-top-p must be in (0, 1], got {config.rollout_top_p}")
    if config.over_sampling_batch_size is not None and config.over_sampling_batch_size < config.rollout_batch_size:
        raise ValueError(
            f"--over-sampling-batch-size ({config.over_sampling_batch_size}) must be >= "
            f"--rollout-batch-size ({config.rollout_batch_size})"
        )
    if config.eval_prompt_data is not None and len(config.eval_prompt_data) % 2:
        raise ValueError(
            "--eval-prompt-data takes pairs: NAME PATH [NAME PATH ...], got "
            f"{config.eval_prompt_data}"
        )
    if not 0 <= config.session_server_port <= 65535:
        raise ValueError(f"--session-server-port must be a TCP port (0 for any free one), got {config.session_server_port}")
    if config.use_session_server and not config.custom_generate_function_path:
        raise ValueError("--use-session-server serves the trajectories of a --custom-generate-function-path "
                         "function; give one (it reads sample.metadata['session_url']), or drop the flag")
    if config.use_dynamic_batch_size and config.max_tokens_per_gpu is None:
        raise ValueError("--use-dynamic-batch-size needs --max-tokens-per-gpu")
    if config.lr < 0:
        raise ValueError(f"--lr must be >= 0, got {config.lr}")
    check_learning_settings(config)
    check_async_settings(config)
    check_sglang_args(config)
    check_eval_rewards(config)  # before the checks that read --eval-prompt-data
    check_training_modes(config)
    check_optim_logging(config)
    check_dashboard(config)
    check_fault_tolerance(config)
    if config.calculate_per_token_loss and config.loss_agg_mode not in (None, "token-mean"):
        raise ValueError(
            f"--calculate-per-token-loss asks for --loss-agg-mode token-mean, but --loss-agg-mode is "
            f"{config.loss_agg_mode}; give one of the two"
        )


def check_async_settings(config: MilesConfig) -> None:
    """The ``--fully-async`` flags: values and combinations that cannot work."""
    if config.update_weights_interval < 1:
        raise ValueError(f"--update-weights-interval must be >= 1 (training steps between weight pushes), got "
                         f"{config.update_weights_interval}")
    if config.max_weight_staleness is not None and config.max_weight_staleness < 0:
        raise ValueError(f"--max-weight-staleness must be >= 0 weight versions, got {config.max_weight_staleness}")
    if config.async_max_concurrent_samples is not None and config.async_max_concurrent_samples < config.n_samples_per_prompt:
        raise ValueError(
            f"--async-max-concurrent-samples ({config.async_max_concurrent_samples}) must hold one group "
            f"(--n-samples-per-prompt {config.n_samples_per_prompt})")
    if not config.async_data_buffer_capacity_factor * config.rollout_batch_size >= 1:
        raise ValueError(
            f"--async-data-buffer-capacity-factor {config.async_data_buffer_capacity_factor:g} x --rollout-batch-size "
            f"{config.rollout_batch_size} leaves no room for a finished group; give a factor of at least "
            f"{1 / config.rollout_batch_size:g}")
    if not config.fully_async:
        return
    if config.offload_rollout or config.offload_train:
        flag = "--offload-rollout" if config.offload_rollout else "--offload-train"
        raise ValueError(
            f"--fully-async with {flag}: fully asynchronous rollout keeps generating while the trainer trains, so "
            "neither side can hand its memory to the other between phases; drop one of the two (--colocate alone "
            "shares the GPUs with both sides resident, or give the engines their own GPUs with --rollout-num-gpus)")
    if config.custom_generate_function_path and config.pause_generation_mode in ("retract", "abort"):
        raise ValueError(
            f"--pause-generation-mode {config.pause_generation_mode} with --custom-generate-function-path: a "
            "trajectory's request cannot be stopped and continued behind the function's back; use in_place (the "
            "default with a generate function: requests continue with the new weights, each token keeps its version)")


def check_learning_settings(config: MilesConfig) -> None:
    """Values that would make a run silently learn nothing, learn backwards, or never
    stop on trouble; ValueError naming the flag and what to give instead."""
    if config.clip_grad <= 0:
        raise ValueError(
            f"--clip-grad must be positive (the bound on the gradient norm), got {config.clip_grad:g}: 0 zeroes "
            "every update and a negative value reverses it; to clip effectively never, give a large value (1e9)"
        )
    for name in ("eps_clip", "eps_clip_high"):
        value = getattr(config, name)
        if value is not None and value < 0:
            raise ValueError(f"{flag_name(name)} must be >= 0 (a PPO clip range), got {value:g}")
    if config.kl_loss_coef != 0 and not config.use_kl_loss:
        raise ValueError(
            f"--kl-loss-coef {config.kl_loss_coef:g} has no effect without --use-kl-loss; add --use-kl-loss, or drop "
            "--kl-loss-coef (--kl-coef shapes the reward instead)"
        )
    if config.save_interval is not None:
        if config.save_interval <= 0:
            raise ValueError(f"--save-interval must be a positive number of rollouts, got {config.save_interval}")
        if not (config.save or config.save_hf):
            raise ValueError("--save-interval needs --save (or --save-hf): there is nowhere to save to")
    if config.max_consecutive_nan_steps < 1:
        raise ValueError(
            f"--max-consecutive-nan-steps must be >= 1, got {config.max_consecutive_nan_steps}: the run stops after "
            "that many optimizer steps in a row with a NaN/Inf loss"
        )
    if not config.worker_timeout > 0:
        raise ValueError(f"--worker-timeout must be a positive number of seconds, got {config.worker_timeout:g}")
    if not 0 <= config.max_failed_sample_fraction <= 1:
        raise ValueError(
            f"--max-failed-sample-fraction must be between 0 and 1, got {config.max_failed_sample_fraction:g}"
        )
