"""``--kl-coef`` reward shaping uses the ``--kl-loss-type`` estimator (as slime does), checked
through the trainer's own construction of the estimator inputs against float64 formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from miles_host.algorithms.advantages import compute_advantages
from miles_host.config import MilesConfig
from miles_host.sample import Sample, Status
from miles_host.trainer import advantage_inputs

OLD = [[-0.3, -1.2, -0.05], [-2.0, -0.4]]
REF = [[-0.9, -0.2, -0.05], [-0.6, -1.9]]


def ref_kl(kind, old, ref):
    """Schulman's estimators with tokens from the old policy: log_ratio = old - ref."""
    d = old - ref
    return {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d, "low_var_kl": min(max(math.exp(-d) - 1 + d, -10), 10)}[kind]


def samples():
    return [
        Sample(tokens=[5, 6, 7, 8, 9], response_length=3, loss_mask=[1, 1, 1], reward=1.0, group_index=0,
               status=Status.COMPLETED),
        Sample(tokens=[5, 6, 7, 8], response_length=2, loss_mask=[1, 1], reward={"score": 0.0}, group_index=0,
               status=Status.COMPLETED),
    ]


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_shaping_follows_kl_loss_type(kind):
    config = MilesConfig(kl_coef=0.2, kl_loss_type=kind, advantage_estimator="reinforce_plus_plus", gamma=1.0)
    old = [torch.tensor(o, dtype=torch.float64) for o in OLD]
    ref = [torch.tensor(r, dtype=torch.float64) for r in REF]
    inputs = advantage_inputs(samples(), ref, old, None, config)
    for got, old_row, ref_row in zip(inputs.token_kl, OLD, REF):
        np.testing.assert_allclose(got.numpy(), [ref_kl(kind, o, r) for o, r in zip(old_row, ref_row)], rtol=1e-12)
    # and the shaped returns: discounted sums of -kl_coef * kl plus the reward on the last token
    returns = compute_advantages("reinforce_plus_plus", inputs, config).returns
    for got, old_row, ref_row, reward in zip(returns, OLD, REF, [1.0, 0.0]):
        token_rewards = [-0.2 * ref_kl(kind, o, r) for o, r in zip(old_row, ref_row)]
        token_rewards[-1] += reward
        expected = [sum(token_rewards[t:]) for t in range(len(token_rewards))]
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6)


def test_estimators_differ_on_these_log_probs():
    """The per-type test above would not catch a fixed k1 if the estimators agreed here."""
    values = {kind: [ref_kl(kind, o, r) for o, r in zip(OLD[0], REF[0])] for kind in ("k1", "k2", "k3")}
    assert values["k1"] != pytest.approx(values["k2"]) and values["k1"] != pytest.approx(values["k3"])


def test_no_kl_without_kl_coef():
    inputs = advantage_inputs(samples(), None, None, None, MilesConfig())
    assert inputs.token_kl is None and inputs.rewards.tolist() == [1.0, 0.0]
