"""Signs that a run is not learning: stop on the ones that cannot fix themselves, warn on the rest.

- A rollout in which more than ``--max-failed-sample-fraction`` of the samples failed
  (reward code that raises or returns no number, a reward server that is down, prompts
  longer than the context) stops the run after that rollout with the first failure's
  message: :class:`TooManyFailedSamples`.
- A gradient norm of exactly 0 for :data:`ZERO_GRAD_ROLLOUTS` rollouts in a row is a
  warning naming the likely cause (:class:`ZeroGradientWatch`).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, TextIO

#: rollouts in a row with a gradient norm of exactly 0 before the warning
ZERO_GRAD_ROLLOUTS = 3


class RunStopped(RuntimeError):
    """The run stopped itself on a condition it detected (the CLI exits with code 1)."""


class TooManyFailedSamples(RunStopped):
    """More than ``--max-failed-sample-fraction`` of a rollout's samples failed."""


def check_failed_fraction(rollout_id: int, failed: int, finished: int, first_failure: str | None, limit: float) -> None:
    """Raise :class:`TooManyFailedSamples` when ``failed / finished`` exceeds ``limit``."""
    if finished == 0 or failed / finished <= limit:
        return
    raise TooManyFailedSamples(
        f"rollout {rollout_id}: {failed} of {finished} samples failed ({failed / finished:.0%}, more than "
        f"--max-failed-sample-fraction {limit:g}); first failure: {first_failure}. Fix its cause (the reward "
        "function or server, prompts longer than the context, ...), or raise --max-failed-sample-fraction to "
        "train on what is left"
    )


def _scored(group: list[Any]) -> list[Any]:
    return [s for s in group if s.reward is not None and s.status.value != "failed"]


def likely_zero_gradient_cause(groups: list[list[Any]], scalar: Callable[[Any], float], config: Any) -> str:
    """Why a rollout's gradient is exactly 0, read from its groups of samples."""
    scored = [g for g in (_scored(group) for group in groups) if g]
    if scored and all(len(group) == 1 for group in scored):
        return (
            "each prompt has one scored sample, which is its own group baseline, so every advantage is 0: give "
            "--n-samples-per-prompt 2 or more"
        )
    if scored and all(len({tuple(s.tokens) for s in group}) == 1 for group in scored):
        return (
            "every sample of a prompt is the same response, so rewards and advantages within each group are "
            f"equal: the policy has collapsed (too large a step: --lr {config.lr:g}?) or samples greedily "
            f"(--rollout-temperature {config.rollout_temperature:g})"
        )
    if all(len({scalar(s.reward) for s in group}) <= 1 for group in scored):
        return (
            "within each prompt's group every response got the same reward, so every advantage is 0: the reward "
            "does not tell the responses apart (check the reward function and the labels)"
        )
    return (
        "the rewards of a group differ but no gradient reaches the weights: check the loss mask of the samples, "
        f"--lr {config.lr:g} and --clip-grad {config.clip_grad:g}"
    )


class ZeroGradientWatch:
    """Counts rollouts in a row whose ``train/grad_norm`` is exactly 0 and warns once per streak."""

    def __init__(self, config: Any, stream: TextIO | None = None):
        self.config = config
        self.stream = stream
        self.streak = 0

    def observe(self, metrics: dict, groups: list[list[Any]], scalar: Callable[[Any], float]) -> str | None:
        """Update with one rollout's metrics and groups; the warning printed now, if any."""
        grad_norm = metrics.get("train/grad_norm")
        if grad_norm is None or grad_norm != 0.0:
            self.streak = 0
            return None
        self.streak += 1
        if self.streak != ZERO_GRAD_ROLLOUTS:
            return None
        message = (
            f"miles: warning: train/grad_norm has been exactly 0 for {self.streak} rollouts in a row, so the "
            f"policy does not change; likely cause: {likely_zero_gradient_cause(groups, scalar, self.config)}"
        )
        print(message, file=self.stream or sys.stderr)
        return message
