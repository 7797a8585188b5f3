"""The critic's clipped value loss against slime's formula, in float64 written out here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles_host.algorithms.value import clipped_value_loss
from miles_host.config import MilesConfig


def _reduce(per_token, mask, lengths, mode):
    """verl's aggregations (slime's two: token-mean, seq-mean-token-mean) with loops."""
    per_token, mask = np.asarray(per_token, dtype=float), np.asarray(mask, dtype=float)
    if mode == "token-mean":
        return (per_token * mask).sum() / mask.sum()
    if mode == "token-sum":
        return (per_token * mask).sum()
    out, start = [], 0
    for n in lengths:
        m, x = mask[start:start + n], per_token[start:start + n]
        out.append((x * m).sum() / (max(m.sum(), 1) if mode == "seq-mean-token-mean" else 1))
        start += n
    return float(np.mean(out))


METRIC_MODE = {"token-mean": "token-mean", "seq-mean-token-mean": "seq-mean-token-mean",
               "seq-mean-token-sum": "seq-mean-token-mean", "token-sum": "token-mean"}


def _reference(values, old, returns, mask, lengths, clip, mode):
    """slime's value_loss_function: max((V_clipped - R)^2, (V - R)^2), clipfrac |V - V_old| > clip
    (a fraction under the mean-type counterpart of a summing mode)."""
    losses, outside = [], []
    for v, o, r in zip(values, old, returns):
        clipped_v = o + min(max(v - o, -clip), clip)
        losses.append(max((clipped_v - r) ** 2, (v - r) ** 2))
        outside.append(float(abs(v - o) > clip))
    return _reduce(losses, mask, lengths, mode), _reduce(outside, mask, lengths, METRIC_MODE[mode])


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"])
def test_clipped_value_loss_matches_slime_formula(mode):
    rng = np.random.default_rng(0)
    lengths = [3, 5, 2]
    n = sum(lengths)
    values, old, returns = rng.normal(size=n), rng.normal(size=n), rng.normal(size=n)
    mask = (rng.random(n) > 0.2).astype(float)
    mask[0] = mask[3] = mask[8] = 1.0
    config = MilesConfig(loss_agg_mode=mode)
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    loss, metrics = clipped_value_loss(t(values), t(old), t(returns), t(mask), lengths, 0.2, config)
    expected_loss, expected_clipfrac = _reference(values, old, returns, mask, lengths, 0.2, mode)
    assert abs(float(loss) - expected_loss) < 1e-12
    assert metrics["value_clipfrac"] == pytest.approx(expected_clipfrac, abs=1e-12)
    assert 0.0 < metrics["value_clipfrac"] < 1.0


def test_calculate_per_token_loss_picks_the_token_mean():
    rng = np.random.default_rng(1)
    lengths = [4, 2]
    values, old, returns = rng.normal(size=6), rng.normal(size=6), rng.normal(size=6)
    mask = np.array([1, 1, 0, 1, 1, 1], dtype=float)
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    loss, _ = clipped_value_loss(t(values), t(old), t(returns), t(mask), lengths, 0.5,
                                 MilesConfig(calculate_per_token_loss=True))
    assert float(loss) == pytest.approx(_reference(values, old, returns, mask, lengths, 0.5, "token-mean")[0], abs=1e-12)


def test_value_loss_gradient_flows_to_values():
    values = torch.tensor([0.5, -0.2], requires_grad=True)
    loss, metrics = clipped_value_loss(values, torch.zeros(2), torch.ones(2), torch.ones(2), [2], None,
                                       MilesConfig(calculate_per_token_loss=True))
    loss.backward()
    # d/dv mean((v - 1)^2) = 2 (v - 1) / 2 = v - 1 (slime's loss has no 1/2 factor)
    assert torch.allclose(values.grad, values.detach() - 1)
    assert metrics["value_clipfrac"] == 0.0
