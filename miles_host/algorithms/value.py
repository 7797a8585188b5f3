"""The PPO critic's loss: clipped value regression (PPO / verl / slime style).

``value_loss = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``,
aggregated over response tokens with the policy loss's aggregation.
"""

from __future__ import annotations

from typing import Sequence

import torch

from miles_host.algorithms.losses import aggregation_for


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    response_lengths: Sequence[int],
    value_clip: float | None,
    config,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The critic loss over packed response tokens ``[N]`` and its metrics."""
    unclipped = (values - returns) ** 2
    if value_clip is None:
        per_token = 0.5 * unclipped
        clipped_fraction = 0.0
    else:
        clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped = (clipped_values - returns) ** 2
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        mask = loss_mask > 0
        clipped_fraction = float(((clipped > unclipped) & mask).sum()) / max(1, int(mask.sum()))
    loss = aggregation_for(config)(per_token, loss_mask, response_lengths)
    metrics = {"value_loss": float(loss.detach()), "value_clipfrac": clipped_fraction,
               "values_mean": float((values.detach() * loss_mask).sum() / loss_mask.sum().clamp(min=1))}
    return loss, metrics
