"""Group statistics and whitening of huge rewards (float64 inside, input dtype out)."""

from __future__ import annotations

import pytest
import torch

from miles_host.algorithms.advantages import AdvantageInputs, compute_advantages
from tests.algorithms.test_advantage_estimators import config, ref_groups, ref_grpo, ref_rloo, ref_whiten


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_huge_float32_rewards_keep_their_advantages(name):
    """Rewards near 1e30 in float32: the group statistics are taken in float64, so the
    squared deviations (1e60) do not overflow and zero every advantage."""
    rewards = [1e30, 0.0, 0.0, 3e30, -2e30, 5e29]
    groups = [0, 0, 0, 1, 1, 1]
    lengths = [2, 1, 3, 1, 2, 2]
    inputs = AdvantageInputs(torch.tensor(rewards, dtype=torch.float32), torch.tensor(groups), lengths)
    out = compute_advantages(name, inputs, config(advantage_estimator=name))
    # float64 reference on the float32 rewards the estimator sees
    seen = [float(r) for r in torch.tensor(rewards, dtype=torch.float32)]
    per_sample = {"grpo": ref_grpo, "rloo": ref_rloo}.get(name)
    if per_sample is not None:
        expected = [[a] * n for a, n in zip(per_sample(seen, groups), lengths)]
    else:  # group-mean baseline, then whitened over the batch's tokens
        means = {g: sum(v) / len(v) for g, v in ref_groups(seen, groups).items()}
        expected = ref_whiten([[r - means[g]] * n for r, g, n in zip(seen, groups, lengths)],
                              [[1] * n for n in lengths])
    for got, want in zip(out.advantages, expected):
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        assert got.tolist() == pytest.approx(want, rel=1e-6)
    assert any(abs(a.abs().max().item()) > 0.1 for a in out.advantages)
