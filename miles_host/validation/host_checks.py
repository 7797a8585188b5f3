"""Checks of the host that need more than the config: registries, files, the machine.

Each ``check_*(config, registries)`` raises a ValueError (FileNotFoundError for a
missing path) naming the flag; :data:`HOST_CHECKS` is the order
:func:`miles_host.validation.validate` runs them in. Add a new one here and to
the tuple.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from miles_host.config import MilesConfig
from miles_host.config_fault_tolerance import check_fault_tolerant_backend
from miles_host.config_fields import flag_name
from miles_host.config_training_modes import check_training_mode_functions, needs_reward
from miles_host.data import missing_data_file
from miles_host.distributed.placement import check_placement, wants_distributed
from miles_host.models.loading import native_config, read_hf_config
from miles_host.opd.checks import check_opd
from miles_host.plugin_manager import model_family_for
from miles_host.devices import resolve_device
from miles_host.lora.checks import check_lora
from miles_host.validation.megatron_args import check_megatron_model_args, check_megatron_training_args
from miles_host.validation.optimizer_checks import check_optimizer_flags
from miles_host.validation.output_paths import check_output_paths

#: flags no backend of this version honours: refused when set
UNSUPPORTED_FLAGS: dict[str, str] = {}

#: speculative flags that only a decoding strategy other than ``plain`` reads
SPECULATIVE_DECODING_FLAGS = (
    "sglang_speculative_num_steps",
    "sglang_speculative_eagle_topk",
    "sglang_speculative_num_draft_tokens",
    "sglang_speculative_draft_model_path",
    "sglang_speculative_token_map",
    "sglang_enable_draft_weights_cpu_backup",
)
#: MTP flags that only online draft training (``--enable-mtp-training``) or a speculative strategy reads
MTP_FLAGS = ("mtp_num_layers", "mtp_loss_scaling_factor")


def decoding_strategy_name(config: Any) -> str:
    """The decoding strategy the run asks for: ``--sglang-speculative-algorithm`` or ``plain``."""
    return (config.sglang_speculative_algorithm or "plain").lower()


def check_registry_names(config: Any, registries: Any) -> None:
    """Names the config picks from registries exist (a typo names the known ones)."""
    registries.advantage_estimators.get(config.advantage_estimator)
    registries.precisions.get(config.precision)
    registries.weight_sync_transports.get(config.weight_sync)
    registries.rollout_backends.get(config.rollout_backend)
    registries.train_backends.get(config.train_backend)
    registries.decoding_strategies.get(decoding_strategy_name(config))
    if config.rm_type is not None:
        registries.reward_functions.get(config.rm_type)


def check_required_inputs(config: Any, registries: Any) -> None:
    """A model directory whose family is installed, a prompt file and a reward."""
    if config.hf_checkpoint is None:
        raise ValueError("--hf-checkpoint is required (an HF-format model directory)")
    if not (Path(config.hf_checkpoint) / "config.json").is_file():
        raise FileNotFoundError(
            f"--hf-checkpoint {config.hf_checkpoint}: no config.json there; give a local HF-format model "
            "directory (models are not downloaded from a hub)"
        )
    model_config(config)  # the loader's reading: family installed, required fields present
    if config.prompt_data is None:
        raise ValueError("--prompt-data is required (a .jsonl or .parquet file of prompts)")
    if not Path(config.prompt_data).is_file():
        raise missing_data_file(config.prompt_data, "--prompt-data")
    if not (config.rm_type or config.custom_rm_path or config.rm_url) and needs_reward(config) and not config.use_opd:
        raise ValueError("no reward configured: set --rm-type, --custom-rm-path or --rm-url (or --use-opd: "
                         "on-policy distillation alone)")


def model_config(config: Any) -> Any:
    """The native model config of ``--hf-checkpoint`` (ValueError as the loader raises it), for checks
    that depend on the model (e.g. routing replay needs MoE layers)."""
    hf = read_hf_config(config.hf_checkpoint)
    return native_config(hf, model_family_for(hf["model_type"]))


def check_user_functions(config: Any, registries: Any) -> None:
    """``module.fn`` flags import and name a function whose contract (slime's or miles') can be called
    (:mod:`miles_host.function_contracts`)."""
    from miles_host.function_contracts import load_adapted

    for name in ("custom_rm_path", "custom_generate_function_path", "dynamic_sampling_filter_path"):
        path = getattr(config, name)
        if path:
            load_adapted(path, name, config)


def check_device(config: Any, registries: Any) -> None:
    """``--device cuda`` needs a CUDA device."""
    resolve_device(config)


def check_placement_flags(config: Any, registries: Any) -> None:
    """Trainer and engine processes this node can hold (one-process runs: their limits)."""
    if wants_distributed(config, registries):
        check_placement(config)
    else:
        check_single_process(config)


def check_single_process(config: Any) -> None:
    """Placement flags a one-process run can honour."""
    if config.actor_num_nodes != 1:
        raise ValueError(f"--actor-num-nodes {config.actor_num_nodes}: several nodes are not supported yet")
    if config.rollout_num_gpus not in (None, 0, 1) and config.rollout_backend == "embedded":
        raise ValueError(
            f"--rollout-num-gpus {config.rollout_num_gpus}: the embedded backend runs one engine in this process; "
            "use --rollout-backend process or sglang for several engines"
        )


def check_unsupported_flags(config: Any, registries: Any) -> None:
    """Flags that no backend of this version honours are refused, never ignored."""
    for name, instead in UNSUPPORTED_FLAGS.items():
        if getattr(config, name) is not None:
            raise ValueError(f"{flag_name(name)} is not supported in this version ({instead}); drop it")


def check_recompute_flags(config: Any, registries: Any) -> None:
    """Activation checkpointing (``--recompute-granularity full``) recomputes every decoder layer,
    each its own checkpoint: Megatron's ``--recompute-method uniform --recompute-num-layers 1``,
    which slime scripts spell out. Other methods are refused."""
    method, layers = config.recompute_method, config.recompute_num_layers
    if method is None and layers is None:
        return
    if config.recompute_granularity != "full":
        raise ValueError("--recompute-method / --recompute-num-layers need --recompute-granularity full")
    if method not in (None, "uniform") or layers not in (None, 1):
        raise ValueError(
            f"--recompute-method {method} --recompute-num-layers {layers}: this version recomputes every decoder "
            "layer on its own (uniform, one layer per checkpoint); use --recompute-method uniform "
            "--recompute-num-layers 1, or drop them"
        )


def check_speculative_flags(config: Any, registries: Any) -> None:
    """Speculative and MTP flags are read only when a speculative strategy or MTP training is on."""
    speculative = decoding_strategy_name(config) != "plain"
    if not speculative:
        for name in SPECULATIVE_DECODING_FLAGS:
            if getattr(config, name) not in (None, False):
                raise ValueError(
                    f"{flag_name(name)} is read only by speculative decoding: add --sglang-speculative-algorithm "
                    "EAGLE (plugin miles-spec), or drop it"
                )
    if not (speculative or config.enable_mtp_training):
        defaults = {"mtp_num_layers": None, "mtp_loss_scaling_factor": _default("mtp_loss_scaling_factor")}
        for name in MTP_FLAGS:
            if getattr(config, name) != defaults[name]:
                raise ValueError(
                    f"{flag_name(name)} is read only by the MTP draft: add --enable-mtp-training (and "
                    "--sglang-speculative-algorithm EAGLE to decode with it; plugin miles-spec), or drop it"
                )
    if config.enable_mtp_training and not any(term.enabled(config) for term in registries.loss_terms):
        raise ValueError("--enable-mtp-training needs a plugin providing the MTP loss term (--plugins spec)")


def check_batch_split(config: Any, registries: Any) -> None:
    """``--global-batch-size`` divides the rollout's samples: a remainder makes a last optimizer
    step of a few samples (16 samples in steps of 5: 5, 5, 5 and 1), a noisy step with the
    weight of a full one. (Not in ``validate_config``: a config of any split can be built, and
    :func:`miles_host.lr_schedule.step_sizes` splits the fewer samples that failures leave.)"""
    size, per_rollout = config.global_batch_size, config.rollout_batch_size * config.n_samples_per_prompt
    if size is not None and per_rollout % size:
        divisors = [d for d in range(1, per_rollout + 1) if per_rollout % d == 0]
        raise ValueError(
            f"--global-batch-size {size} does not divide the {per_rollout} samples of a rollout (--rollout-batch-size "
            f"{config.rollout_batch_size} x --n-samples-per-prompt {config.n_samples_per_prompt}); give one of "
            f"{', '.join(map(str, divisors))}"
        )


def _default(name: str) -> Any:
    return MilesConfig.__dataclass_fields__[name].default


HOST_CHECKS: tuple[Callable[[Any, Any], None], ...] = (
    check_registry_names,
    check_required_inputs,
    check_megatron_model_args,
    check_megatron_training_args,
    check_output_paths,
    check_user_functions,
    check_training_mode_functions,
    check_device,
    check_placement_flags,
    check_unsupported_flags,
    check_recompute_flags,
    check_speculative_flags,
    check_batch_split,
    check_optimizer_flags,
    check_opd,
    check_lora,
    check_fault_tolerant_backend,
)
