"""Flags of the loss type, the rollout function and the debug replay (slime's spellings).

- ``--loss-type`` (``policy_loss``, ``sft_loss``, ``custom_loss``), ``--custom-loss-function-path``,
  ``--custom-pg-loss-reducer-function-path`` and ``--disable-compute-advantages-and-returns``:
  what the trainer minimises (:mod:`miles_host.loss_types`).
- ``--rollout-function-path``: a slime-contract ``generate_rollout(args, rollout_id,
  data_source, evaluation=False)`` replaces the built-in rollout manager
  (:mod:`miles_host.rollout_function`; slime's SFT rollout maps to :mod:`miles_host.sft`).
- ``--save-debug-rollout-data``, ``--load-debug-rollout-data``, ``--debug-rollout-only``,
  ``--debug-train-only``: dump each step's samples, replay them into the trainer;
  ``--save-debug-train-data``: what each step trained on, with the trainer's log-probs;
  ``--dump-details DIR``: both dumps under one directory (:mod:`miles_host.debug_rollout`).

:func:`check_training_modes` checks their values and combinations (called by
:func:`miles_host.config.validate_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles_host.config_fields import flag

LOSS_TYPES = ("policy_loss", "sft_loss", "custom_loss")


@dataclass
class TrainingModeArgs:
    loss_type: str = flag("policy_loss", "what the trainer minimises: policy_loss (the RL policy loss), sft_loss (negative log-likelihood of the loss-masked response tokens, reduced by --loss-agg-mode), custom_loss (--custom-loss-function-path)", type=str, choices=list(LOSS_TYPES), group="algorithm")
    custom_loss_function_path: str | None = flag(None, "--loss-type custom_loss: module.fn(args, batch, logits, sum_of_sample_mean) -> (loss, metrics), slime's signature (batch: slime's keys plus miles_log_probs; logits [1, T, V])", type=str, group="algorithm")
    custom_pg_loss_reducer_function_path: str | None = flag(None, "module.fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer of the per-token policy-gradient loss (slime's signature; the reducer returns the micro-batch's sum as slime's sum_of_sample_mean does); other terms keep the default reduction", type=str, group="algorithm")
    disable_compute_advantages_and_returns: bool = flag(False, "do not compute advantages (they are zero): for sft_loss or a custom loss that does not read them", group="algorithm")
    rollout_function_path: str | None = flag(None, "module.fn(args, rollout_id, data_source, evaluation=False) returning groups of samples (slime's contract; a RolloutFnTrainOutput-like object with .samples and .metrics too) instead of the built-in rollout manager; slime.rollout.sft_rollout.generate_rollout is miles_host.sft.generate_rollout, slime's default slime.rollout.sglang_rollout.generate_rollout the built-in manager; evaluation keeps the built-in rollout", type=str, group="rollout")
    save_debug_rollout_data: str | None = flag(None, "write each step's samples to this path ({rollout_id} is substituted), as slime does: torch.save of {'rollout_id', 'samples'}", type=str, group="debug")
    save_debug_train_data: str | None = flag(None, "write what each step trained on to this path ({rollout_id} and {rank} are substituted), as slime does: torch.save of {'rollout_id', 'rank', 'rollout_data'} with the tokens, response lengths, loss masks, rewards, rollout log-probs and the trainer's log-probs of the same tokens", type=str, group="debug")
    dump_details: str | None = flag(None, "dump everything for post-hoc analysis under this directory (slime's spelling): sets --save-debug-rollout-data DIR/rollout_data/{rollout_id}.pt and --save-debug-train-data DIR/train_data/{rollout_id}_{rank}.pt where they are not given", type=str, group="debug")
    load_debug_rollout_data: str | None = flag(None, "train on the samples saved by --save-debug-rollout-data at this path ({rollout_id} substituted) instead of generating; implies --debug-train-only", type=str, group="debug")
    load_debug_rollout_data_subsample: float | None = flag(None, "keep this fraction of each loaded rollout (its first and last halves, as slime does)", type=float, group="debug")
    debug_rollout_only: bool = flag(False, "generate (and save with --save-debug-rollout-data) without training: no trainer step, no weight sync", group="debug")
    debug_train_only: bool = flag(False, "train without a rollout engine: the samples come from --load-debug-rollout-data or an engine-free --rollout-function-path (slime's SFT rollout); no weight sync, no evaluation", group="debug")


def trains_only(config: Any) -> bool:
    """No rollout engine: ``--debug-train-only``, or ``--load-debug-rollout-data`` (which implies it, as in slime)."""
    return bool(config.debug_train_only or config.load_debug_rollout_data)


def check_training_modes(config: Any) -> None:
    """Values and combinations of the :class:`TrainingModeArgs` flags that cannot work;
    ValueError naming the flag."""
    if config.loss_type == "custom_loss" and not config.custom_loss_function_path:
        raise ValueError("--loss-type custom_loss needs --custom-loss-function-path module.fn")
    if config.custom_loss_function_path and config.loss_type != "custom_loss":
        raise ValueError(f"--custom-loss-function-path is only used with --loss-type custom_loss (the loss type is "
                         f"{config.loss_type}); add --loss-type custom_loss, or drop the path")
    if config.custom_pg_loss_reducer_function_path and config.loss_type != "policy_loss":
        raise ValueError(f"--custom-pg-loss-reducer-function-path reduces the policy loss, but --loss-type is "
                         f"{config.loss_type}; drop one of the two")
    if config.debug_rollout_only and trains_only(config):
        which = "--debug-train-only" if config.debug_train_only else "--load-debug-rollout-data (which implies --debug-train-only)"
        raise ValueError(f"--debug-rollout-only and {which} cannot be set at the same time; set only one of them")
    for name in ("save_debug_rollout_data", "load_debug_rollout_data"):
        template = getattr(config, name)
        if template is not None:
            check_path_template(template, "--" + name.replace("_", "-"))
    if config.save_debug_train_data is not None:
        check_path_template(config.save_debug_train_data, "--save-debug-train-data", extra_fields=("rank",))
    fraction = config.load_debug_rollout_data_subsample
    if fraction is not None:
        if config.load_debug_rollout_data is None:
            raise ValueError("--load-debug-rollout-data-subsample needs --load-debug-rollout-data")
        if not 0 < fraction <= 1:
            raise ValueError(f"--load-debug-rollout-data-subsample must be in (0, 1], got {fraction:g}")
    if config.eval_prompt_data and trains_only(config):
        raise ValueError("--eval-prompt-data with --debug-train-only (or --load-debug-rollout-data): no rollout engine "
                         "is started to generate the eval answers; drop one of the two")
    if config.fully_async and (config.rollout_function_path or config.debug_rollout_only or trains_only(config)):
        raise ValueError(
            "--fully-async generates with the built-in rollout on its own thread; --rollout-function-path, "
            "--load-debug-rollout-data, --debug-rollout-only and --debug-train-only run in the synchronous loop: "
            "drop --fully-async")


def check_path_template(template: str, flag_text: str, extra_fields: tuple[str, ...] = ()) -> None:
    """A ``{rollout_id}`` path template formats (other placeholders than ``extra_fields`` are an
    error naming them)."""
    try:
        template.format(rollout_id=0, **{name: 0 for name in extra_fields})
    except (KeyError, IndexError, ValueError) as error:
        allowed = ", ".join("{" + name + "}" for name in ("rollout_id", *extra_fields))
        raise ValueError(f"{flag_text} {template!r}: the placeholders are {allowed} ({error!r})") from None


def needs_reward(config: Any) -> bool:
    """Whether the run scores samples with its own reward (``--rm-type`` / ``--custom-rm-path`` /
    ``--rm-url``): the built-in rollout generates the training samples, or there is an evaluation.
    Loaded samples and a rollout function's carry their rewards (slime's contract)."""
    from miles_host.rollout_function import resolve_rollout_function_path

    generated_here = not trains_only(config) and resolve_rollout_function_path(config.rollout_function_path) is None
    return generated_here or bool(config.eval_prompt_data)


def check_training_mode_functions(config: Any, registries: Any) -> None:
    """The ``module.fn`` flags of :class:`TrainingModeArgs` import and name a function (a host
    check of :mod:`miles_host.validation`)."""
    from miles_host.loss_types import _function
    from miles_host.rollout_function import load_rollout_function

    for name in ("custom_loss_function_path", "custom_pg_loss_reducer_function_path"):
        path = getattr(config, name)
        if path:
            _function(path, "--" + name.replace("_", "-"))
    function = load_rollout_function(config.rollout_function_path)
    no_advantages = config.disable_compute_advantages_and_returns or config.loss_type == "sft_loss"
    if no_advantages and registries.advantage_estimators.get(config.advantage_estimator).needs_critic:
        raise ValueError(f"--advantage-estimator {config.advantage_estimator} trains a critic on the returns, which "
                         f"--loss-type {config.loss_type} / --disable-compute-advantages-and-returns do not compute; "
                         "use a critic-free estimator (the default grpo)")
    if config.debug_train_only and function is None and not config.load_debug_rollout_data:
        raise ValueError("--debug-train-only starts no rollout engine, so the built-in rollout has nothing to generate "
                         "with; give --load-debug-rollout-data PATH (samples saved by --save-debug-rollout-data) or an "
                         "engine-free --rollout-function-path (e.g. slime.rollout.sft_rollout.generate_rollout)")
