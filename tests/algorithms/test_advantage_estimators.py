"""Advantage estimators against plain-python float64 references."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from miles_host.config import MilesConfig
from miles_host.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    discounted_cumsum,
)

# ----------------------------------------------------------------------------
# references (python loops over floats)
# ----------------------------------------------------------------------------


def ref_groups(rewards, groups):
    members = {}
    for index, group in enumerate(groups):
        members.setdefault(group, []).append(rewards[index])
    return members


def ref_grpo(rewards, groups, use_std=True):
    members = ref_groups(rewards, groups)
    out = []
    for reward, group in zip(rewards, groups):
        values = members[group]
        advantage = reward - sum(values) / len(values)
        if use_std:
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            advantage /= std + 1e-6
        out.append(advantage)
    return out


def ref_rloo(rewards, groups):
    out = []
    for i, (reward, group) in enumerate(zip(rewards, groups)):
        others = [rewards[j] for j in range(len(rewards)) if groups[j] == group and j != i]
        out.append(reward - sum(others) / len(others) if others else 0.0)
    return out


def ref_whiten(per_seq, masks):
    flat = [x for seq in per_seq for x in seq]
    flat_mask = [m for seq in masks for m in seq]
    count = sum(flat_mask)
    mean = sum(x * m for x, m in zip(flat, flat_mask)) / count
    var = sum((x - mean) ** 2 * m for x, m in zip(flat, flat_mask)) / (count - 1)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in seq] for seq in per_seq]


def ref_token_rewards(reward, kl, mask, kl_coef):
    rewards = [-kl_coef * k * m for k, m in zip(kl, mask)]
    last = max(t for t, m in enumerate(mask) if m > 0)
    rewards[last] += reward
    return rewards


def ref_discounted(rewards, gamma):
    out, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def ref_gae(rewards, values, gamma, lambd, mask=None):
    """verl's compute_gae_advantage_return as a loop: a loss-masked-out token has no value and
    no TD error (the next value and the running advantage pass through it); its advantage is 0."""
    mask = [1.0] * len(rewards) if mask is None else mask
    advantages, running, next_value = [0.0] * len(rewards), 0.0, 0.0
    for t in reversed(range(len(rewards))):
        if mask[t] == 0:
            continue
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lambd * running
        advantages[t] = running
        next_value = values[t]
    return advantages, [a + v for a, v in zip(advantages, values)]


# ----------------------------------------------------------------------------
# fixtures
# ----------------------------------------------------------------------------


def make_problem(rng, lengths=(7, 1, 12, 300, 4, 9, 140, 3, 5), groups=(3, 3, 3, 8, 8, 1, 1, 1, 5)):
    lengths, groups = list(lengths), list(groups)
    rewards = rng.normal(size=len(lengths)).tolist()
    rewards[0] = rewards[1]  # ties inside a group are fine
    kl = [np.abs(rng.normal(size=n)).tolist() for n in lengths]
    values = [rng.normal(size=n).tolist() for n in lengths]
    masks = []
    for n in lengths:
        mask = (rng.random(n) > 0.3).astype(float)
        mask[n // 2] = 1.0
        if n > 2:
            mask[-1] = 0.0  # a trailing tool-output token: reward goes to the last masked-in token
        masks.append(mask.tolist())
    inputs = AdvantageInputs(
        rewards=torch.tensor(rewards, dtype=torch.float64),
        group_index=torch.tensor(groups),
        response_lengths=lengths,
        values=[torch.tensor(v, dtype=torch.float64) for v in values],
        token_kl=[torch.tensor(k, dtype=torch.float64) for k in kl],
        loss_masks=[torch.tensor(m, dtype=torch.float64) for m in masks],
    )
    return inputs, rewards, groups, kl, values, masks


def config(**overrides):
    base = dict(gamma=1.0, lambd=1.0, kl_coef=0.0, disable_grpo_std_normalization=False, normalize_advantages=False)
    return MilesConfig(**{**base, **overrides})


def assert_lists_close(got, expected, tol=1e-10):
    assert [len(g) for g in got] == [len(e) for e in expected]
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g.numpy(), e, rtol=tol, atol=tol)


# ----------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------


def test_registry_names():
    assert set(ADVANTAGE_ESTIMATORS) >= {
        "grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo", "ppo",
    }


@pytest.mark.parametrize("name", ["grpo", "gspo", "cispo"])
@pytest.mark.parametrize("use_std", [True, False])
def test_grpo_family(rng, name, use_std):
    inputs, rewards, groups, *_ = make_problem(rng)
    out = compute_advantages(name, inputs, config(disable_grpo_std_normalization=not use_std))
    per_sample = ref_grpo(rewards, groups, use_std)
    expected = [[a] * n for a, n in zip(per_sample, inputs.response_lengths)]
    assert_lists_close(out.advantages, expected)
    assert_lists_close(out.returns, expected)


def test_grpo_without_rewards_normalization_uses_raw_reward(rng):
    inputs, rewards, *_ = make_problem(rng)
    out = compute_advantages("grpo", inputs, config(disable_rewards_normalization=True))
    assert_lists_close(out.advantages, [[r] * n for r, n in zip(rewards, inputs.response_lengths)])


def test_disable_rewards_normalization_flag_reaches_the_baseline_estimator(rng):
    """``--disable-rewards-normalization`` (slime's flag): reinforce_plus_plus_baseline keeps the
    raw reward (minus the KL), no group mean; whitened as always."""
    inputs, rewards, _, kl, _, masks = make_problem(rng)
    out = compute_advantages("reinforce_plus_plus_baseline", inputs,
                             config(disable_rewards_normalization=True, kl_coef=0.1))
    raw = [[r - 0.1 * k for k in kls] for r, kls in zip(rewards, kl)]
    assert_lists_close(out.returns, raw)
    assert_lists_close(out.advantages, ref_whiten(raw, masks))


def test_grpo_normalize_advantages_whitens_tokens(rng):
    inputs, rewards, groups, _, _, masks = make_problem(rng)
    out = compute_advantages("grpo", inputs, config(normalize_advantages=True))
    raw = [[a] * n for a, n in zip(ref_grpo(rewards, groups), inputs.response_lengths)]
    assert_lists_close(out.advantages, ref_whiten(raw, masks))
    assert_lists_close(out.returns, raw)


def test_rloo(rng):
    inputs, rewards, groups, *_ = make_problem(rng)
    out = compute_advantages("rloo", inputs, config(kl_coef=0.3))
    expected = [[a] * n for a, n in zip(ref_rloo(rewards, groups), inputs.response_lengths)]
    assert_lists_close(out.advantages, expected)


@pytest.mark.parametrize("gamma,kl_coef", [(1.0, 0.0), (0.97, 0.1), (0.0, 0.05)])
def test_reinforce_plus_plus(rng, gamma, kl_coef):
    inputs, rewards, _, kl, _, masks = make_problem(rng)
    out = compute_advantages("reinforce_plus_plus", inputs, config(gamma=gamma, kl_coef=kl_coef))
    returns = [ref_discounted(ref_token_rewards(r, k, m, kl_coef), gamma) for r, k, m in zip(rewards, kl, masks)]
    assert_lists_close(out.returns, returns)
    assert_lists_close(out.advantages, ref_whiten(returns, masks))


@pytest.mark.parametrize("kl_coef", [0.0, 0.2])
def test_reinforce_plus_plus_baseline(rng, kl_coef):
    inputs, rewards, groups, kl, _, masks = make_problem(rng)
    out = compute_advantages("reinforce_plus_plus_baseline", inputs, config(kl_coef=kl_coef))
    members = ref_groups(rewards, groups)
    raw = [
        [r - sum(members[g]) / len(members[g]) - kl_coef * k for k in kls]
        for r, g, kls in zip(rewards, groups, kl)
    ]
    assert_lists_close(out.returns, raw)
    assert_lists_close(out.advantages, ref_whiten(raw, masks))


@pytest.mark.parametrize("gamma,lambd,kl_coef", [(1.0, 1.0, 0.0), (0.99, 0.95, 0.1), (0.9, 0.0, 0.0)])
@pytest.mark.parametrize("normalize", [False, True])
def test_ppo_gae(rng, gamma, lambd, kl_coef, normalize):
    inputs, rewards, _, kl, values, masks = make_problem(rng)
    cfg = config(gamma=gamma, lambd=lambd, kl_coef=kl_coef, normalize_advantages=normalize)
    out = compute_advantages("ppo", inputs, cfg)
    pairs = [
        ref_gae(ref_token_rewards(r, k, m, kl_coef), v, gamma, lambd, m)
        for r, k, m, v in zip(rewards, kl, masks, values)
    ]
    advantages = [a for a, _ in pairs]
    assert_lists_close(out.returns, [ret for _, ret in pairs])
    assert_lists_close(out.advantages, ref_whiten(advantages, masks) if normalize else advantages)


def test_ppo_masked_tail_values_do_not_enter_the_trained_advantages():
    """Trailing loss-mask zeros (a tool output after the answer): the reward sits on the last
    trained token and bootstrapping ends there, so the critic's values of the masked tail,
    which it never trains on, do not move the trained tokens' advantages."""
    mask = [1.0, 1.0, 0.0, 0.0]

    def trained_advantages(tail_values):
        values = [0.3, 0.1, *tail_values]
        inputs = AdvantageInputs(
            rewards=torch.tensor([1.0], dtype=torch.float64), group_index=torch.tensor([0]), response_lengths=[4],
            values=[torch.tensor(values, dtype=torch.float64)], loss_masks=[torch.tensor(mask, dtype=torch.float64)],
        )
        out = compute_advantages("ppo", inputs, config(gamma=0.9, lambd=0.8))
        expected = ref_gae(ref_token_rewards(1.0, [0.0] * 4, mask, 0.0), values, 0.9, 0.8, mask)[0]
        assert_lists_close(out.advantages, [expected])
        return out.advantages[0][:2].tolist()

    at_zero = trained_advantages([0.0, 0.0])
    # by hand: delta_1 = 1 - 0.1 = 0.9, delta_0 = 0.9 * 0.1 - 0.3 = -0.21, A_0 = -0.21 + 0.72 * 0.9 = 0.438
    assert at_zero == pytest.approx([0.438, 0.9], abs=1e-12)
    assert trained_advantages([5.0, -3.0]) == pytest.approx(at_zero, abs=1e-12)


def test_float32_matches_float64_reference(rng):
    inputs, rewards, groups, kl, values, masks = make_problem(rng, lengths=(6, 11, 4, 9), groups=(0, 0, 1, 1))
    as32 = AdvantageInputs(
        rewards=inputs.rewards.float(),
        group_index=inputs.group_index,
        response_lengths=inputs.response_lengths,
        values=[v.float() for v in inputs.values],
        token_kl=[k.float() for k in inputs.token_kl],
        loss_masks=[m.float() for m in inputs.loss_masks],
    )
    cfg = config(gamma=0.99, lambd=0.95, kl_coef=0.1)
    out = compute_advantages("ppo", as32, cfg)
    expected = [
        ref_gae(ref_token_rewards(r, k, m, 0.1), v, 0.99, 0.95, m)[0] for r, k, m, v in zip(rewards, kl, masks, values)
    ]
    assert out.advantages[0].dtype == torch.float32
    assert_lists_close(out.advantages, expected, tol=1e-5)
    grpo = compute_advantages("grpo", as32, cfg)
    expected_grpo = [[a] * n for a, n in zip(ref_grpo(rewards, groups), inputs.response_lengths)]
    assert_lists_close(grpo.advantages, expected_grpo, tol=1e-5)


@pytest.mark.parametrize("discount", [0.0, 0.5, 0.999, 1.0])
@pytest.mark.parametrize("steps", [1, 127, 128, 129, 300])
def test_discounted_cumsum_chunks(rng, discount, steps):
    values = rng.normal(size=(3, steps))
    got = discounted_cumsum(torch.tensor(values), discount)
    expected = [ref_discounted(list(row), discount) for row in values]
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-10, atol=1e-10)


def test_errors(rng):
    inputs, *_ = make_problem(rng)
    with pytest.raises(ValueError, match="grpo"):
        compute_advantages("a2c", inputs, config())
    no_critic = AdvantageInputs(inputs.rewards, inputs.group_index, inputs.response_lengths)
    with pytest.raises(ValueError, match="values"):
        compute_advantages("ppo", no_critic, config())
    with pytest.raises(ValueError, match="token_kl"):
        compute_advantages("reinforce_plus_plus", no_critic, config(kl_coef=0.1))
    with pytest.raises(ValueError, match="match response_lengths"):
        AdvantageInputs(inputs.rewards, inputs.group_index, inputs.response_lengths, values=inputs.values[:-1])
    with pytest.raises(ValueError, match="one entry per response"):
        AdvantageInputs(inputs.rewards[:-1], inputs.group_index, inputs.response_lengths)
    masked_out = [torch.zeros(n, dtype=torch.float64) for n in inputs.response_lengths]
    fully_masked = AdvantageInputs(inputs.rewards, inputs.group_index, inputs.response_lengths, loss_masks=masked_out)
    with pytest.raises(ValueError, match="no loss-masked token"):
        compute_advantages("reinforce_plus_plus", fully_masked, config())
