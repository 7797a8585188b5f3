"""How many optimizer steps a run takes, and the learning-rate schedule over them.

One rollout gives ``--rollout-batch-size x --n-samples-per-prompt`` samples (the
rollout manager refills groups that dynamic sampling filters out, so the count is
fixed); :func:`step_sizes` splits them into optimizer steps, and every trainer
(native, data-parallel, FSDP, Megatron) trains with that split. The loop multiplies
the steps of one rollout by the number of rollouts (:func:`total_optimizer_steps`) and,
as slime does with Megatron's ``train_iters``, makes that the length of the decay when
``--lr-decay-iters`` is not given (:func:`resolve_lr_decay_iters`).

Samples that cannot be trained on (failed, empty, unscored) leave a rollout with fewer
samples, at worst one step fewer: the schedule then ends a little above ``--min-lr``,
never early.
"""

from __future__ import annotations

import math
from typing import Any, Callable


def step_sizes(num_samples: int, config: Any) -> list[int]:
    """The number of samples in each optimizer step of one rollout of ``num_samples``.

    ``--global-batch-size G``: steps of ``G`` samples, the last one the remainder.
    Otherwise ``--num-steps-per-rollout K`` steps (default 1) of as equal a size as the
    samples allow (``num_samples < K``: one sample per step).
    """
    if num_samples <= 0:
        return []
    if config.global_batch_size is not None:
        full, rest = divmod(num_samples, config.global_batch_size)
        return [config.global_batch_size] * full + ([rest] if rest else [])
    steps = min(config.num_steps_per_rollout or 1, num_samples)
    base, extra = divmod(num_samples, steps)
    return [base + 1] * extra + [base] * (steps - extra)


def samples_per_rollout(config: Any) -> int:
    """Samples one rollout hands the trainer: ``--rollout-batch-size x --n-samples-per-prompt``."""
    return config.rollout_batch_size * config.n_samples_per_prompt


def total_optimizer_steps(config: Any, num_rollouts: int) -> int:
    """Optimizer steps of a run of ``num_rollouts`` rollouts."""
    return num_rollouts * len(step_sizes(samples_per_rollout(config), config))


def resolve_lr_decay_iters(config: Any, num_rollouts: int) -> None:
    """Set ``config.lr_decay_iters`` to the run's optimizer steps when the user gave none
    (Megatron's default: the decay spans the whole run)."""
    if config.lr_decay_iters is None:
        config.lr_decay_iters = total_optimizer_steps(config, num_rollouts)


def lr_lambda(config: Any) -> Callable[[int], float]:
    """Warm-up then constant / linear / cosine decay to ``--min-lr`` (as a factor of ``--lr``).

    The factor of optimizer step ``s`` (0-based): ``(s + 1) / W`` during the ``W = --lr-warmup-iters``
    warm-up steps, then the decay over ``--lr-decay-iters`` steps counted from the start
    (Megatron's convention: the warm-up is part of them), so the last of them runs just
    above ``--min-lr``. A decaying style needs ``--lr-decay-iters``, which the loop fills in.
    """
    warmup, decay_steps = config.lr_warmup_iters, config.lr_decay_iters
    if config.lr_decay_style != "constant" and decay_steps is None:
        raise ValueError(
            f"--lr-decay-style {config.lr_decay_style} needs the length of the decay: give --lr-decay-iters "
            "(miles run sets it to the run's number of optimizer steps)"
        )
    floor = config.min_lr / config.lr if config.lr > 0 else 0.0

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if config.lr_decay_style == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, decay_steps - warmup))
        if config.lr_decay_style == "linear":
            return floor + (1 - floor) * (1 - progress)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
