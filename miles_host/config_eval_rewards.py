"""Evaluation and reward flags of slime's spellings that :mod:`miles_host.config` lacks.

- ``--eval-config``: slime's per-dataset evaluation YAML (:mod:`miles_host.eval_config`);
  it replaces ``--eval-prompt-data``, whose name/path pairs it then holds.
- ``--eval-input-key`` / ``--eval-label-key`` / ``--eval-tool-key``: the eval data's keys
  (default: ``--input-key`` ...), ``--eval-top-k`` (default: ``--rollout-top-k``),
  ``--eval-reward-key`` (default: ``--reward-key``).
- ``--rollout-sample-filter-path``: slime's per-sample loss filter (:mod:`miles_host.sample_filters`).
- ``--custom-reward-post-process-path``: slime's reward post-process
  (:mod:`miles_host.reward_post_process`).
- ``--buffer-filter-path``: slime's partial-rollout buffer filter (:mod:`miles_host.buffer_filter`).
- ``--log-passrate``: pass@k of every eval data set (k = 1, 2, 4, ... up to its samples per
  prompt), slime's unbiased estimator over the samples whose reward is 1.

:func:`check_eval_rewards` checks them and reads ``--eval-config`` (called by
:func:`miles_host.config.validate_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles_host.config_fields import flag, optional_int


@dataclass
class EvalRewardArgs:
    eval_config: str | None = flag(None, "YAML file of evaluation data sets (slime's format: eval.defaults and eval.datasets, each with name, path and optional rm_type, custom_rm_path, input_key, label_key, tool_key, metadata_key, n_samples_per_eval_prompt, temperature, top_p, top_k, max_response_len, metadata_overrides); overrides --eval-prompt-data", type=str, group="eval")
    eval_input_key: str | None = flag(None, "prompt key of the eval data (default: --input-key)", type=str, group="eval")
    eval_label_key: str | None = flag(None, "label key of the eval data (default: --label-key)", type=str, group="eval")
    eval_tool_key: str | None = flag(None, "tools key of the eval data (default: --tool-key)", type=str, group="eval")
    eval_reward_key: str | None = flag(None, "key of an eval reward that is a dict (default: --reward-key)", type=str, group="eval")
    eval_top_k: int | None = flag(None, "eval top-k (default: --rollout-top-k)", type=optional_int, group="eval")
    rollout_sample_filter_path: str | None = flag(None, "module.fn(args, groups) after the built-in rollout (slime's contract): it sets sample.remove_sample = True on samples whose tokens must not enter the loss (their loss mask becomes zeros; their reward still counts in the group's normalisation)", type=str, group="rollout")
    custom_reward_post_process_path: str | None = flag(None, "module.fn(args, samples) -> (raw_rewards, rewards), slime's contract: the rewards the advantages use instead of the group normalisation (turns on --disable-rewards-normalization); samples: the step's unfailed samples", type=str, group="reward")
    buffer_filter_path: str | None = flag(None, "module.fn(args, rollout_id, buffer, num_samples) -> the groups of the --partial-rollout buffer the next rollout continues (slime's contract; it pops them from buffer, the rest waits); default: all of them", type=str, group="rollout")
    log_passrate: bool = flag(False, "log eval/<name>/pass@k for k = 1, 2, 4, ... up to the samples per eval prompt (unbiased estimator; a sample passes when its reward is 1)", group="eval")


def check_eval_rewards(config: Any) -> None:
    """Read ``--eval-config`` (errors name the file and what is wrong) and put its name/path
    pairs into ``--eval-prompt-data``, as slime does."""
    if config.eval_top_k is not None and config.eval_top_k == 0:
        raise ValueError("--eval-top-k must be -1 (off) or a positive number, got 0")
    if getattr(config, "fully_async", False):
        for name in ("rollout_sample_filter_path", "buffer_filter_path", "custom_reward_post_process_path"):
            if getattr(config, name):
                raise ValueError(f"--{name.replace('_', '-')} with --fully-async: the fully asynchronous producer "
                                 "does not run it; drop one of the two")
    from miles_host.reward_post_process import check_post_process

    check_post_process(config)
    if config.eval_config:
        from miles_host.eval_config import load_eval_config

        datasets = load_eval_config(config)
        config.eval_prompt_data = [item for dataset in datasets for item in (dataset.name, dataset.path)]
