"""slime/Megatron flags of the optimizer, data balancing, checkpoint retention, log-prob
chunking, chat-template arguments and experiment tracking (wandb, TensorBoard).

Spellings and defaults are slime's (``slime/utils/arguments.py``) or Megatron-LM's
(``megatron/training/arguments.py``); each help text says what the flag does here.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from miles_host.config_fields import flag, optional_int

#: optimizers by ``--optimizer`` name: the torch class each trainer that builds its own
#: optimizer (native, DP, FSDP) uses
OPTIMIZERS = ("adam", "sgd")


def json_dict(text: str) -> dict[str, Any]:
    """argparse type: a JSON object (``'{"enable_thinking": false}'``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error}): {text!r}") from error
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {type(value).__name__}: {text!r}")
    return value


@dataclass
class OptimizerArgs:
    optimizer: str = flag("adam", "optimizer (Megatron's spelling): adam (AdamW with --adam-beta1/2, --adam-eps, --weight-decay) "
                          "or sgd (--sgd-momentum, --weight-decay)", type=str, choices=OPTIMIZERS, group="train")
    sgd_momentum: float = flag(0.9, "momentum of --optimizer sgd (Megatron's default)", type=float, group="train")
    optimizer_cpu_offload: bool = flag(False, "keep the optimizer state on CPU and take the optimizer step there: gradients "
                                       "are copied to float32 CPU master parameters, stepped, and the parameters copied "
                                       "back (native trainer; other backends refuse it)", group="train")
    balance_data: bool = flag(False, "split each optimizer step's samples across data-parallel ranks so every rank gets "
                              "about the same number of tokens (longest first onto the lightest rank); without it "
                              "sample i goes to rank i %% world, as in slime", group="train")
    log_probs_chunk_size: int = flag(-1, "tokens per chunk of the trainer's log-prob computation (the lm-head logits "
                                     "of one chunk exist at a time, forward and backward); -1: the model's default of "
                                     "1024 (the trainer always chunks, so slime's -1, no chunking, is not offered); "
                                     "the values are the same either way", type=int, group="train")


@dataclass
class TisLevelArgs:
    tis_level: str = flag("token", "level of the --use-tis ratio (slime's MIS spelling): token (each token's), "
                          "sequence (the product over the sequence's tokens) or geometric (their geometric mean), "
                          "then truncated to [--tis-clip-low, --tis-clip]", type=str,
                          choices=["token", "sequence", "geometric"], group="correction")


@dataclass
class RetentionArgs:
    save_retain_interval: int | None = flag(None, "keep the checkpoints of rollouts that are multiples of this "
                                            "interval (and the newest one); delete the other --save checkpoints as "
                                            "newer ones are written (default: keep all)", type=optional_int,
                                            group="checkpoint")


@dataclass
class ChatTemplateArgs:
    apply_chat_template_kwargs: dict = flag({}, "JSON object of extra keyword arguments to the tokenizer's "
                                            "apply_chat_template with --apply-chat-template (e.g. "
                                            "'{\"enable_thinking\": false}')", type=json_dict, group="data")


@dataclass
class TrackingArgs:
    wandb_mode: str | None = flag(None, "wandb mode: online, offline or disabled (default: wandb's, or WANDB_MODE)",
                                  type=str, choices=["online", "offline", "disabled"], group="output")
    wandb_key: str | None = flag(None, "wandb API key: wandb.login(key=...) before the run starts", type=str, group="output")
    wandb_host: str | None = flag(None, "wandb server URL (self-hosted wandb)", type=str, group="output")
    wandb_team: str | None = flag(None, "wandb entity (team) of the run", type=str, group="output")
    wandb_group: str | None = flag(None, "wandb group of the run (also its name prefix, as slime names runs)", type=str,
                                   group="output")
    wandb_dir: str | None = flag(None, "directory of wandb's local files (default: --output-dir)", type=str, group="output")
    wandb_run_id: str | None = flag(None, "resume this wandb run id (wandb.init(id=..., resume='allow'))", type=str,
                                    group="output")
    disable_wandb_random_suffix: bool = flag(False, "name the wandb run exactly --wandb-group (slime appends a random "
                                             "suffix otherwise)", group="output")
    wandb_always_use_train_step: bool = flag(False, "slime compatibility: accepted and ignored (every metric is logged "
                                             "against the rollout step)", group="output")
    log_multi_turn: bool = flag(False, "slime compatibility: accepted and ignored (multi-turn samples keep their turns "
                                "in the samples --save-debug-rollout-data writes)", group="output")
    tb_project_name: str | None = flag(None, "TensorBoard: event files go to <TENSORBOARD_DIR or --output-dir/"
                                       "tensorboard>/<this>/<--tb-experiment-name>", type=str, group="output")
    tb_experiment_name: str | None = flag(None, "TensorBoard experiment (sub-directory under --tb-project-name)", type=str,
                                          group="output")


#: flags of this module accepted only so that slime scripts parse (one warning each when given:
#: :mod:`miles_host.validation.ignored_flags`)
TRACKING_IGNORED: dict[str, str] = {
    "wandb_always_use_train_step": "every metric is logged against the rollout step (one x-axis for all)",
    "log_multi_turn": "multi-turn samples keep their turns in the samples --save-debug-rollout-data writes",
}


@dataclass
class OptimLoggingArgs(OptimizerArgs, TisLevelArgs, RetentionArgs, ChatTemplateArgs, TrackingArgs):
    """The flags of this module, one base of :class:`miles_host.config.MilesConfig`."""


def check_optim_logging(config: Any) -> None:
    """Values of this module's flags that cannot work; ValueError naming the flag."""
    if config.save_retain_interval is not None and config.save_retain_interval <= 0:
        raise ValueError(f"--save-retain-interval must be a positive number of rollouts, got {config.save_retain_interval}")
    if config.save_retain_interval is not None and not config.save:
        raise ValueError("--save-retain-interval needs --save: it chooses which --save checkpoints to keep")
    if config.save_retain_interval is not None and config.save_interval and config.save_retain_interval % config.save_interval:
        raise ValueError(f"--save-retain-interval {config.save_retain_interval} must be a multiple of --save-interval "
                         f"{config.save_interval} (as Megatron asserts): otherwise no saved checkpoint is retained")
    if config.log_probs_chunk_size == 0 or config.log_probs_chunk_size < -1:
        raise ValueError(f"--log-probs-chunk-size must be a positive number of tokens or -1 (all at once), got "
                         f"{config.log_probs_chunk_size}")
    if config.tis_level != "token" and not config.use_tis:
        raise ValueError(f"--tis-level {config.tis_level} sets the level of the --use-tis ratio; add --use-tis (or "
                         "--use-mis with --mis-level for masked importance sampling)")
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer {config.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
