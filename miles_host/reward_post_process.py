"""``--custom-reward-post-process-path``: slime's replacement of the reward normalisation.

slime calls ``post_process(args, samples)`` with the step's samples (a flat list) and
expects ``(raw_rewards, rewards)``, one number each per sample: ``rewards`` are what the
advantages are computed from, and slime's own group normalisation is skipped. Here the
function gets the samples that did not fail (a failed one has no reward); each sample's
``reward`` becomes its ``rewards`` entry and its raw reward is kept in
``metadata["raw_reward"]``. :func:`check_post_process` turns on
``--disable-rewards-normalization`` with the flag, so the group estimators do not normalise
a second time.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from miles_host.reward import load_function
from miles_host.sample import Sample, Status

FLAG = "--custom-reward-post-process-path"


def check_post_process(config: Any) -> None:
    """With the flag, the rewards it returns are used as they are (slime skips its normalisation)."""
    if config.custom_reward_post_process_path and not config.disable_rewards_normalization:
        config.disable_rewards_normalization = True
        print(f"miles: {FLAG}: the rewards it returns replace the group normalisation "
              "(--disable-rewards-normalization is on, as slime skips its normalisation)", file=sys.stderr)


def apply_reward_post_process(config: Any, groups: list[list[Sample]], function: Any = None) -> dict[str, float]:
    """Run the post-process on the scored samples of ``groups``, in place; its metrics."""
    path = config.custom_reward_post_process_path
    if function is None and not path:
        return {}
    function = function or load_function(path, FLAG)
    samples = [s for group in groups for s in group if s.status is not Status.FAILED]
    result = function(config, samples)
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise TypeError(f"{FLAG} {path}: returned {type(result).__name__}; slime's contract returns "
                        "(raw_rewards, rewards), two lists with one number per sample")
    raw_rewards, rewards = (list(part) for part in result)
    if len(raw_rewards) != len(samples) or len(rewards) != len(samples):
        raise ValueError(f"{FLAG} {path}: got {len(raw_rewards)} raw rewards and {len(rewards)} rewards for "
                         f"{len(samples)} samples")
    for sample, raw, reward in zip(samples, raw_rewards, rewards):
        value = float(reward)
        if not math.isfinite(value):
            raise ValueError(f"{FLAG} {path}: reward {reward} is not a finite number")
        sample.metadata["raw_reward"] = float(raw)
        sample.reward = value
    count = max(1, len(samples))
    return {"rollout/raw_reward_mean": sum(map(float, raw_rewards)) / count,
            "rollout/post_processed_reward_mean": sum(map(float, rewards)) / count}
