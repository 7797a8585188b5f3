"""The critic's clipped value loss against a float64 formula written out here."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from miles_host.algorithms.value import clipped_value_loss


def _reference(values, old, returns, mask, lengths, clip, per_token):
    losses = []
    for v, o, r in zip(values, old, returns):
        unclipped = (v - r) ** 2
        clipped = (o + min(max(v - o, -clip), clip) - r) ** 2
        losses.append(0.5 * max(unclipped, clipped))
    losses, mask = np.array(losses), np.array(mask)
    if per_token:
        return (losses * mask).sum() / mask.sum()
    out, start = [], 0
    for n in lengths:
        m = mask[start:start + n]
        out.append((losses[start:start + n] * m).sum() / max(m.sum(), 1))
        start += n
    return float(np.mean(out))


def test_clipped_value_loss_matches_float64_formula():
    rng = np.random.default_rng(0)
    lengths = [3, 5, 2]
    n = sum(lengths)
    values, old, returns = rng.normal(size=n), rng.normal(size=n), rng.normal(size=n)
    mask = (rng.random(n) > 0.2).astype(float)
    mask[0] = mask[3] = mask[8] = 1.0
    for per_token in (True, False):
        config = SimpleNamespace(calculate_per_token_loss=per_token)
        t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
        loss, metrics = clipped_value_loss(t(values), t(old), t(returns), t(mask), lengths, 0.2, config)
        assert abs(float(loss) - _reference(values, old, returns, mask, lengths, 0.2, per_token)) < 1e-12
        assert 0.0 <= metrics["value_clipfrac"] <= 1.0


def test_value_loss_gradient_flows_to_values():
    values = torch.tensor([0.5, -0.2], requires_grad=True)
    loss, _ = clipped_value_loss(values, torch.zeros(2), torch.ones(2), torch.ones(2), [2], None,
                                 SimpleNamespace(calculate_per_token_loss=True))
    loss.backward()
    # d/dv 0.5 * mean((v - 1)^2) = (v - 1) / 2
    assert torch.allclose(values.grad, (values.detach() - 1) / 2)
