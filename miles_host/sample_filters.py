"""``--rollout-sample-filter-path``: slime's per-sample loss filter.

slime calls ``filter(args, samples)`` with the rollout's groups (``list[list[Sample]]``)
after the built-in rollout; the function sets ``sample.remove_sample = True`` on the
samples that must not train and returns None. Those samples keep their reward (they still
count in the group's advantage normalisation, as in slime) but their loss mask becomes all
zeros, so no token of theirs enters the loss.
"""

from __future__ import annotations

from typing import Any

from miles_host.reward import load_function
from miles_host.sample import Sample

FLAG = "--rollout-sample-filter-path"


def apply_rollout_sample_filter(config: Any, groups: list[list[Sample]], function: Any = None) -> int:
    """Run the filter (``function``, else loaded from the flag) on ``groups`` and zero the loss
    mask of every sample it marked; how many it marked (0 without the flag)."""
    path = config.rollout_sample_filter_path
    if function is None and not path:
        return 0
    function = function or load_function(path, FLAG)
    result = function(config, groups)
    if result is not None:
        raise TypeError(f"{FLAG} {path}: the filter returned {type(result).__name__}; it must return None and set "
                        "sample.remove_sample = True on the samples to leave out of the loss")
    removed = 0
    for group in groups:
        for sample in group:
            if getattr(sample, "remove_sample", False):
                sample.loss_mask = [0] * sample.response_length
                removed += 1
    return removed
