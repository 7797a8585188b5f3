"""The OPD penalty through the advantages into the policy loss, and its gradient, against
float64 formulas written with Python loops (upstream miles: ``A_t - opd_kl_coef *
(student_logp_t - teacher_logp_t)``, applied before whitening)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from miles_host.algorithms.advantages import AdvantageInputs, compute_advantages
from miles_host.algorithms.losses import PolicyLossBatch, policy_loss
from miles_host.config import MilesConfig
from miles_host.opd.penalty import opd_penalties
from miles_host.sample import Sample, Status

LENGTHS = [3, 5, 2, 4]  # one group of four samples
COEF = 0.7


def make_samples(rng: np.random.Generator, rewards: list[float]):
    samples, old = [], []
    for i, (length, reward) in enumerate(zip(LENGTHS, rewards)):
        mask = [1] * length
        mask[1] = 0  # a token outside the loss (e.g. a tool answer)
        sample = Sample(tokens=list(range(2, 6 + length)), response_length=length, reward=reward, loss_mask=mask,
                        status=Status.COMPLETED, group_index=0, index=i,
                        teacher_log_probs=(-np.abs(rng.normal(size=length)) - 0.1).tolist())
        samples.append(sample)
        old.append(torch.tensor(-np.abs(rng.normal(size=length)) - 0.1, dtype=torch.float32))
    return samples, old


def ref_grpo(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
    return [(r - mean) / (std + 1e-6) for r in rewards]


def ref_advantages(samples, old, rewards, coef) -> list[list[float]]:
    base = ref_grpo(rewards)
    return [[base[i] - coef * (float(o) - t) for o, t in zip(old[i].tolist(), s.teacher_log_probs)]
            for i, s in enumerate(samples)]


def ref_loss_and_grad(log_probs, old, advantages, masks, mode):
    """PPO surrogate (no clipping reached) reduced by ``mode``; d loss / d log_prob per token."""
    loss, grad = 0.0, []
    if mode == "token-mean":
        count = sum(sum(m) for m in masks)
        for lp, o, a, m in zip(log_probs, old, advantages, masks):
            for x, y, adv, keep in zip(lp, o, a, m):
                ratio = math.exp(x - y)
                loss += -ratio * adv * keep / count
                grad.append(-ratio * adv * keep / count)
    else:  # seq-mean-token-mean
        for lp, o, a, m in zip(log_probs, old, advantages, masks):
            count = sum(m)
            for x, y, adv, keep in zip(lp, o, a, m):
                ratio = math.exp(x - y)
                loss += -ratio * adv * keep / count / len(masks)
                grad.append(-ratio * adv * keep / count / len(masks))
    return loss, grad


def host_loss(samples, old, log_probs_list, config):
    penalties, metrics = opd_penalties(samples, old, config)
    inputs = AdvantageInputs(
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        group_index=torch.zeros(len(samples), dtype=torch.long), response_lengths=LENGTHS,
        loss_masks=[torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples])
    advantages = compute_advantages("grpo", inputs, config, token_penalties=penalties).advantages
    log_probs = torch.cat(log_probs_list).double().requires_grad_(True)
    batch = PolicyLossBatch(log_probs=log_probs, advantages=torch.cat(advantages).double(),
                            loss_mask=torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.float64),
                            response_lengths=LENGTHS, old_log_probs=torch.cat(old).double())
    loss, _ = policy_loss(batch, config)
    loss.backward()
    return loss, log_probs.grad, advantages, metrics


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("rewards", [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]], ids=["with_reward", "opd_alone"])
def test_opd_loss_and_gradient_match_float64(mode, rewards):
    rng = np.random.default_rng(0)
    samples, old = make_samples(rng, rewards)
    config = MilesConfig(use_opd=True, opd_type="embedded", opd_kl_coef=COEF, loss_agg_mode=mode)
    # the current policy a little off the old one (ratios near 1, inside the clip range)
    log_probs_list = [o + 0.05 * torch.tensor(rng.normal(size=len(o)), dtype=torch.float32) for o in old]
    loss, grad, advantages, _ = host_loss(samples, old, log_probs_list, config)
    want_adv = ref_advantages(samples, old, rewards, COEF)
    for have, want in zip(advantages, want_adv):
        np.testing.assert_allclose(have.numpy(), want, rtol=1e-5, atol=1e-6)
    want_loss, want_grad = ref_loss_and_grad([lp.double().tolist() for lp in log_probs_list],
                                             [o.double().tolist() for o in old], want_adv,
                                             [s.loss_mask for s in samples], mode)
    assert float(loss.detach()) == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(grad.numpy(), want_grad, rtol=1e-5, atol=1e-7)


def test_at_the_old_policy_the_gradient_is_the_reverse_kl_reinforce_gradient():
    """Pure OPD at ratio 1: d loss / d logp_t = coef * (student_t - teacher_t) * mask_t / N."""
    rng = np.random.default_rng(1)
    samples, old = make_samples(rng, [0.0] * 4)
    config = MilesConfig(use_opd=True, opd_type="embedded", opd_kl_coef=COEF, loss_agg_mode="token-mean")
    _, grad, _, _ = host_loss(samples, old, [o.clone() for o in old], config)
    count = sum(sum(s.loss_mask) for s in samples)
    want = [COEF * (o - t) * m / count for s, lp in zip(samples, old)
            for o, t, m in zip(lp.double().tolist(), s.teacher_log_probs, s.loss_mask)]
    np.testing.assert_allclose(grad.numpy(), want, rtol=1e-5, atol=1e-8)


def test_metrics_are_loss_masked_token_means():
    rng = np.random.default_rng(2)
    samples, old = make_samples(rng, [0.0] * 4)
    config = MilesConfig(use_opd=True, opd_type="embedded", opd_kl_coef=COEF)
    _, metrics = opd_penalties(samples, old, config)
    pairs = [(o, t) for s, lp in zip(samples, old) for o, t, m in zip(lp.double().tolist(), s.teacher_log_probs,
                                                                       s.loss_mask) if m]
    assert metrics["opd/kl"] == pytest.approx(sum(o - t for o, t in pairs) / len(pairs), rel=1e-6)
    assert metrics["opd/abs_log_prob_gap"] == pytest.approx(sum(abs(o - t) for o, t in pairs) / len(pairs), rel=1e-6)
    assert metrics["opd/teacher_log_prob"] == pytest.approx(sum(t for _, t in pairs) / len(pairs), rel=1e-6)
    assert metrics["opd/student_log_prob"] == pytest.approx(sum(o for o, _ in pairs) / len(pairs), rel=1e-6)


def test_penalty_comes_before_whitening():
    rng = np.random.default_rng(3)
    rewards = [1.0, 0.0, 0.5, 0.0]
    samples, old = make_samples(rng, rewards)
    config = MilesConfig(use_opd=True, opd_type="embedded", opd_kl_coef=COEF, normalize_advantages=True)
    _, _, advantages, _ = host_loss(samples, old, [o.clone() for o in old], config)
    raw = ref_advantages(samples, old, rewards, COEF)
    kept = [a for row, s in zip(raw, samples) for a, m in zip(row, s.loss_mask) if m]
    mean = sum(kept) / len(kept)
    std = math.sqrt(sum((a - mean) ** 2 for a in kept) / (len(kept) - 1))
    have = torch.cat(advantages).numpy()
    want = [(a - mean) / (std + 1e-8) for row in raw for a in row]
    np.testing.assert_allclose(have, want, rtol=1e-4, atol=1e-5)


def test_rollout_log_probs_are_the_student_with_use_rollout_logprobs():
    rng = np.random.default_rng(4)
    samples, old = make_samples(rng, [0.0] * 4)
    for s in samples:
        s.rollout_log_probs = (-np.abs(rng.normal(size=s.response_length))).tolist()
    config = MilesConfig(use_opd=True, opd_type="embedded", opd_kl_coef=2.0, use_rollout_logprobs=True)
    penalties, _ = opd_penalties(samples, None, config)
    for s, p in zip(samples, penalties):
        np.testing.assert_allclose(p.numpy(), [2.0 * (r - t) for r, t in zip(s.rollout_log_probs, s.teacher_log_probs)],
                                   rtol=1e-6)


def test_a_sample_without_teacher_log_probs_is_named():
    rng = np.random.default_rng(5)
    samples, old = make_samples(rng, [0.0] * 4)
    samples[2].teacher_log_probs = None
    with pytest.raises(ValueError, match="sample 2 .* has no teacher_log_probs"):
        opd_penalties(samples, old, MilesConfig(use_opd=True, opd_type="embedded"))
