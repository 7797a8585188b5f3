"""The PPO critic's loss: clipped value regression, as slime's ``value_loss_function``
(``slime/backends/megatron_utils/loss.py``).

``value_loss = max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)`` per token (no
``1/2`` factor, as in slime), aggregated over response tokens with the policy loss's
aggregation (``--loss-agg-mode`` / ``--calculate-per-token-loss``). ``value_clipfrac``
is the fraction of ``|V - V_old| > c`` under that aggregation's mean-type counterpart
(the same one for slime's two modes). Without a clip range
(``--value-clip none``) the loss is ``(V - R)^2`` and the clip fraction 0.
"""

from __future__ import annotations

from typing import Sequence

import torch

from miles_host.algorithms.losses import aggregation_for, metric_aggregation_for


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
    reduce = aggregation_for(config)
    unclipped = (values - returns) ** 2
    if value_clip is None:
        per_token = unclipped
        clipped_fraction = 0.0
    else:
        clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
        per_token = torch.maximum(unclipped, (clipped_values - returns) ** 2)
        outside = ((values - old_values).abs() > value_clip).to(values.dtype)
        clipped_fraction = float(metric_aggregation_for(config)(outside.detach(), loss_mask, response_lengths))
    loss = reduce(per_token, loss_mask, response_lengths)
    metrics = {"value_loss": float(loss.detach()), "value_clipfrac": clipped_fraction,
               "values_mean": float((values.detach() * loss_mask).sum() / loss_mask.sum().clamp(min=1))}
    return loss, metrics
