"""Policy loss against per-token float64 references written with python loops."""

from __future__ import annotations

import math
import numpy as np
import pytest
import torch

from miles_host.config import MilesConfig
from miles_host.algorithms.losses import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    PolicyLossBatch,
    micro_batch_share,
    policy_loss,
)

# ----------------------------------------------------------------------------
# references
# ----------------------------------------------------------------------------


def ref_surrogate(ratio, advantage, eps_low, eps_high, eps_c):
    """(loss, clipped?, dual-clipped?) for one token."""
    unclipped = -ratio * advantage
    clipped = -min(max(ratio, 1 - eps_low), 1 + eps_high) * advantage
    loss = max(unclipped, clipped)
    dual = False
    if eps_c is not None and advantage < 0:
        dual = -eps_c * advantage < loss
        loss = min(loss, -eps_c * advantage)
    return loss, float(clipped > unclipped), float(dual)


def ref_ratios(p, old, kind):
    if kind != "gspo":
        return [math.exp(a - b) for a, b in zip(p.log_probs, old)]
    ratios = []
    for seg in p.segments():
        mask = p.loss_mask[seg]
        diff = sum((o - a) * m for a, o, m in zip(p.log_probs[seg], old[seg], mask)) / max(sum(mask), 1)
        ratios += [math.exp(-diff)] * (seg.stop - seg.start)
    return ratios


def ref_reduce(values, p, mode, normalizer=None):
    if mode in ("token-mean", "token-sum"):
        total = sum(v * m for v, m in zip(values, p.loss_mask))
        default = max(sum(p.loss_mask), 1) if mode == "token-mean" else 1
        return total / (normalizer if normalizer is not None else default)
    per_seq = []
    for seg in p.segments():
        mask = p.loss_mask[seg]
        token_sum = sum(v * m for v, m in zip(values[seg], mask))
        per_seq.append(token_sum / max(sum(mask), 1) if mode == "seq-mean-token-mean" else token_sum)
    return sum(per_seq) / (normalizer if normalizer is not None else len(per_seq))


def ref_k3(p, q):
    return math.exp(q - p) - 1 - (q - p)


def as_batch(p, dtype=torch.float64, **extra):
    t = lambda a: torch.tensor(a, dtype=dtype)  # noqa: E731
    log_probs = t(p.log_probs).requires_grad_(True)
    fields = dict(
        log_probs=log_probs,
        advantages=t(p.advantages),
        loss_mask=t(p.loss_mask),
        response_lengths=p.lengths,
        old_log_probs=t(p.old_log_probs),
        rollout_log_probs=t(p.rollout_log_probs),
        ref_log_probs=t(p.ref_log_probs),
        entropy=t(p.entropy),
    )
    fields.update(extra)
    return PolicyLossBatch(**fields)


def config(**overrides):
    base = dict(
        eps_clip=0.2, eps_clip_high=None, eps_clip_c=None, advantage_estimator="grpo",
        use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1", entropy_coef=0.0,
        loss_agg_mode="token-mean", use_rollout_logprobs=False, use_tis=False,
    )
    return MilesConfig(**{**base, **overrides})


# ----------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------


def test_registries():
    assert set(LOSS_AGGREGATIONS) == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"}
    assert set(POLICY_LOSSES) == {"ppo", "gspo", "cispo"}


CLIP_CASES = {
    "symmetric": dict(eps_clip=0.2),
    "asymmetric": dict(eps_clip=0.2, eps_clip_high=0.28),
    "dual": dict(eps_clip=0.2, eps_clip_c=3.0),
    "asymmetric_dual": dict(eps_clip=0.1, eps_clip_high=0.3, eps_clip_c=1.5),
}


@pytest.mark.parametrize("case", sorted(CLIP_CASES))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
def test_clipped_policy_loss(packed, case, mode, estimator):
    flags = CLIP_CASES[case]
    cfg = config(loss_agg_mode=mode, advantage_estimator=estimator, **flags)
    loss, metrics = policy_loss(as_batch(packed), cfg)

    eps_high = flags.get("eps_clip_high") or flags["eps_clip"]
    ratios = ref_ratios(packed, packed.old_log_probs, estimator)
    per_token = [ref_surrogate(r, a, flags["eps_clip"], eps_high, flags.get("eps_clip_c"))
                 for r, a in zip(ratios, packed.advantages)]
    losses, clipped, dual = (np.array(column) for column in zip(*per_token))
    assert clipped.sum() > 0 and (dual.sum() > 0 or "eps_clip_c" not in flags)
    assert loss.item() == pytest.approx(ref_reduce(losses, packed, mode), abs=1e-10, rel=1e-10)
    assert metrics["pg_clipfrac"] == pytest.approx(ref_reduce(clipped, packed, mode), abs=1e-10)
    ppo_kl = -np.log(ratios)
    assert metrics["ppo_kl"] == pytest.approx(ref_reduce(ppo_kl, packed, mode), abs=1e-10)
    if "eps_clip_c" in flags:
        assert metrics["dual_clipfrac"] == pytest.approx(ref_reduce(dual, packed, mode), abs=1e-10)
    assert metrics["loss"] == pytest.approx(loss.item(), abs=1e-12)


def test_simple_ppo_gradient_is_analytic(packed):
    cfg = config(eps_clip=0.2, eps_clip_high=0.25)
    batch = as_batch(packed)
    loss, _ = policy_loss(batch, cfg)
    loss.backward()
    count = packed.loss_mask.sum()
    expected = []
    for p, o, a, m in zip(packed.log_probs, packed.old_log_probs, packed.advantages, packed.loss_mask):
        ratio = math.exp(p - o)
        _, clipped, _ = ref_surrogate(ratio, a, 0.2, 0.25, None)
        # d(-ratio * A)/dp = -ratio * A where the unclipped term is taken, 0 where the clip wins
        expected.append(0.0 if clipped else -ratio * a * m / count)
    assert any(e == 0.0 for e in expected) and any(e != 0.0 for e in expected)
    np.testing.assert_allclose(batch.log_probs.grad.numpy(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_full_loss_gradcheck(packed, estimator, mode):
    """Finite differences through clip, dual clip, KL loss (unbiased) and corrections.

    (CISPO's stop-gradient makes its gradient differ from the loss's derivative on
    purpose; ``test_cispo_value_and_gradient`` checks it analytically.)
    """
    cfg = config(
        advantage_estimator=estimator, loss_agg_mode=mode, eps_clip=0.2, eps_clip_high=0.3, eps_clip_c=3.0,
        use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", use_unbiased_kl=True,
        entropy_coef=0.01, use_tis=True, tis_clip=1.5, tis_clip_low=0.5,
    )
    base = as_batch(packed)

    def loss_of(log_probs):
        batch = PolicyLossBatch(**{**base.__dict__, "log_probs": log_probs})
        return policy_loss(batch, cfg)[0]

    torch.autograd.gradcheck(loss_of, (base.log_probs,), eps=1e-7, atol=1e-6)


def test_cispo_value_and_gradient(packed):
    cfg = config(advantage_estimator="cispo", eps_clip=1.0, eps_clip_high=0.5, loss_agg_mode="seq-mean-token-mean")
    batch = as_batch(packed)
    loss, metrics = policy_loss(batch, cfg)
    loss.backward()
    ratios = ref_ratios(packed, packed.old_log_probs, "ppo")
    truncated = np.array([min(max(r, 0.0), 1.5) for r in ratios])
    values = -truncated * packed.advantages * packed.log_probs
    assert loss.item() == pytest.approx(ref_reduce(values, packed, "seq-mean-token-mean"), abs=1e-10)
    assert metrics["pg_clipfrac"] == pytest.approx(
        ref_reduce((truncated != np.array(ratios)).astype(float), packed, "seq-mean-token-mean"), abs=1e-10
    )
    expected_grad = np.zeros_like(values)
    for seg in packed.segments():
        count = max(packed.loss_mask[seg].sum(), 1)
        expected_grad[seg] = -truncated[seg] * packed.advantages[seg] * packed.loss_mask[seg] / count
    expected_grad /= len(packed.lengths)
    np.testing.assert_allclose(batch.log_probs.grad.numpy(), expected_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3", "low_var_kl"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_kl_and_entropy_terms(packed, kl_type, mode):
    cfg = config(use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type=kl_type, entropy_coef=0.02, loss_agg_mode=mode)
    loss, metrics = policy_loss(as_batch(packed), cfg)
    diffs = packed.log_probs - packed.ref_log_probs
    kl = {
        "k1": diffs,
        "k2": diffs**2 / 2,
        "k3": np.array([ref_k3(a, b) for a, b in zip(packed.log_probs, packed.ref_log_probs)]),
    }
    kl["low_var_kl"] = np.clip(kl["k3"], -10, 10)
    ratios = ref_ratios(packed, packed.old_log_probs, "ppo")
    pg = np.array([ref_surrogate(r, a, 0.2, 0.2, None)[0] for r, a in zip(ratios, packed.advantages)])
    kl_loss = ref_reduce(kl[kl_type], packed, mode)
    entropy_loss = ref_reduce(packed.entropy, packed, mode)
    expected = ref_reduce(pg, packed, mode) - 0.02 * entropy_loss + 0.3 * kl_loss
    assert loss.item() == pytest.approx(expected, abs=1e-10)
    assert metrics["kl_loss"] == pytest.approx(kl_loss, abs=1e-10)
    assert metrics["entropy_loss"] == pytest.approx(entropy_loss, abs=1e-10)


ALL_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"]
#: the mean-type mode that reports metrics under each loss mode
METRIC_MODE = {"token-mean": "token-mean", "seq-mean-token-mean": "seq-mean-token-mean",
               "seq-mean-token-sum": "seq-mean-token-mean", "token-sum": "token-mean"}


@pytest.mark.parametrize("mode", ALL_MODES)
def test_loss_agg_modes(packed, mode):
    """``--loss-agg-mode`` (verl's names) against the loop reference of each mode."""
    loss, metrics = policy_loss(as_batch(packed), config(loss_agg_mode=mode, entropy_coef=0.01))
    ratios = ref_ratios(packed, packed.old_log_probs, "ppo")
    pg = np.array([ref_surrogate(r, a, 0.2, 0.2, None)[0] for r, a in zip(ratios, packed.advantages)])
    expected = ref_reduce(pg, packed, mode) - 0.01 * ref_reduce(packed.entropy, packed, mode)
    assert loss.item() == pytest.approx(expected, abs=1e-10)
    assert metrics["pg_loss"] == pytest.approx(ref_reduce(pg, packed, METRIC_MODE[mode]), abs=1e-10)
    clipped = np.array([ref_surrogate(r, a, 0.2, 0.2, None)[1] for r, a in zip(ratios, packed.advantages)])
    assert metrics["pg_clipfrac"] == pytest.approx(ref_reduce(clipped, packed, METRIC_MODE[mode]), abs=1e-10)
    assert 0 < metrics["pg_clipfrac"] < 1  # a fraction whatever the loss sums


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("split", [[2, 4], [1, 1, 1, 3], [6]])
def test_micro_batch_shares_add_up_to_the_step_loss(packed, mode, split):
    """The trainer's gradient accumulation: micro-batch losses weighted by ``micro_batch_share``
    sum to the aggregation over the whole optimizer step, for every mode; so do the metrics
    weighted by their own share."""
    cfg = config(loss_agg_mode=mode)
    whole, whole_metrics = policy_loss(as_batch(packed), cfg)
    clipfrac = 0.0
    starts = np.cumsum([0] + packed.lengths)
    step_masks = [packed.loss_mask[starts[i]:starts[i + 1]] for i in range(len(packed.lengths))]
    total, first = 0.0, 0
    for count in split:
        token_slice = slice(starts[first], starts[first + count])
        sub = PolicyLossBatch(**{
            name: (getattr(as_batch(packed), name)[token_slice] if name != "response_lengths"
                   else packed.lengths[first:first + count])
            for name in ("log_probs", "advantages", "loss_mask", "response_lengths", "old_log_probs",
                         "rollout_log_probs", "ref_log_probs", "entropy")
        })
        loss, metrics = policy_loss(sub, cfg)
        total += loss.item() * micro_batch_share(cfg, step_masks[first:first + count], step_masks)
        clipfrac += metrics["pg_clipfrac"].item() * micro_batch_share(
            cfg, step_masks[first:first + count], step_masks, for_metrics=True)
        first += count
    assert total == pytest.approx(whole.item(), abs=1e-10)
    assert clipfrac == pytest.approx(whole_metrics["pg_clipfrac"].item(), abs=1e-10)


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3", "low_var_kl"])
def test_use_unbiased_kl_weights_the_kl_by_the_ratio(packed, kl_type):
    """``--use-unbiased-kl``: each token's KL estimate times ``pi / pi_old`` (the clamp of
    low_var_kl after the product), as slime's compute_approx_kl with importance_ratio."""
    cfg = config(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type=kl_type, use_unbiased_kl=True)
    _, metrics = policy_loss(as_batch(packed), cfg)
    _, plain = policy_loss(as_batch(packed), config(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type=kl_type))
    diffs = packed.log_probs - packed.ref_log_probs
    estimate = {"k1": diffs, "k2": diffs**2 / 2,
                "k3": np.array([ref_k3(a, b) for a, b in zip(packed.log_probs, packed.ref_log_probs)])}
    estimate["low_var_kl"] = estimate["k3"]
    weighted = np.exp(packed.log_probs - packed.old_log_probs) * estimate[kl_type]
    if kl_type == "low_var_kl":
        weighted = np.clip(weighted, -10, 10)
    assert metrics["kl_loss"] == pytest.approx(ref_reduce(weighted, packed, "token-mean"), abs=1e-10)
    assert abs(metrics["kl_loss"] - plain["kl_loss"]) > 1e-3


def test_rollout_logprobs_as_old_and_default_old(packed):
    cfg = config(use_rollout_logprobs=True)
    loss, metrics = policy_loss(as_batch(packed), cfg)
    ratios = ref_ratios(packed, packed.rollout_log_probs, "ppo")
    pg = [ref_surrogate(r, a, 0.2, 0.2, None)[0] for r, a in zip(ratios, packed.advantages)]
    assert loss.item() == pytest.approx(ref_reduce(np.array(pg), packed, "token-mean"), abs=1e-10)
    # metrics compare the trainer's old log-probs with the rollout's
    diff = np.abs(packed.old_log_probs - packed.rollout_log_probs)
    assert metrics["train_rollout_logprob_abs_diff"] == pytest.approx(ref_reduce(diff, packed, "token-mean"))

    on_policy = as_batch(packed, old_log_probs=None, rollout_log_probs=None)
    loss, metrics = policy_loss(on_policy, config())
    expected = -ref_reduce(packed.advantages, packed, "token-mean")  # ratio == 1
    assert loss.item() == pytest.approx(expected, abs=1e-10)
    assert metrics["pg_clipfrac"] == 0.0 and "train_rollout_kl" not in metrics


def test_loss_normalizer_replaces_the_denominator(packed):
    token, _ = policy_loss(as_batch(packed), config(loss_agg_mode="token-mean"), normalizer=100.0)
    ratios = ref_ratios(packed, packed.old_log_probs, "ppo")
    pg = np.array([ref_surrogate(r, a, 0.2, 0.2, None)[0] for r, a in zip(ratios, packed.advantages)])
    assert token.item() == pytest.approx(ref_reduce(pg, packed, "token-mean", 100.0), abs=1e-12)
    seq, metrics = policy_loss(as_batch(packed), config(loss_agg_mode="seq-mean-token-mean"), normalizer=64)
    assert seq.item() == pytest.approx(ref_reduce(pg, packed, "seq-mean-token-mean", 64), abs=1e-12)
    assert metrics["loss"] == pytest.approx(ref_reduce(pg, packed, "seq-mean-token-mean"), abs=1e-12)


def test_calculate_per_token_loss_picks_token_mean(packed):
    per_token = config(calculate_per_token_loss=True, loss_agg_mode=None)
    per_sequence = config(calculate_per_token_loss=False, loss_agg_mode=None)
    ratios = ref_ratios(packed, packed.old_log_probs, "ppo")
    pg = np.array([ref_surrogate(r, a, 0.2, 0.2, None)[0] for r, a in zip(ratios, packed.advantages)])
    assert policy_loss(as_batch(packed), per_token)[0].item() == pytest.approx(ref_reduce(pg, packed, "token-mean"))
    assert policy_loss(as_batch(packed), per_sequence)[0].item() == pytest.approx(
        ref_reduce(pg, packed, "seq-mean-token-mean")
    )


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_tis_and_icepop_in_the_loss(packed, mode):
    cfg = config(loss_agg_mode=mode, use_tis=True, use_icepop=True, tis_clip=1.4, tis_clip_low=0.6)
    loss, metrics = policy_loss(as_batch(packed), cfg)
    ratios = ref_ratios(packed, packed.old_log_probs, "ppo")
    pg = np.array([ref_surrogate(r, a, 0.2, 0.2, None)[0] for r, a in zip(ratios, packed.advantages)])
    is_ratio = np.exp(packed.old_log_probs - packed.rollout_log_probs)
    tis = np.clip(is_ratio, 0.6, 1.4)
    icepop = np.where((is_ratio >= 0.6) & (is_ratio <= 1.4), is_ratio, 0.0)
    # rejected tokens leave the numerator, the denominators keep the original mask
    assert loss.item() == pytest.approx(ref_reduce(pg * tis * icepop, packed, mode), abs=1e-10)
    assert 0 < metrics["tis_clipfrac"] < 1 and 0 < metrics["icepop_mask_fraction"] < 1


def test_float32_matches_float64_reference(packed):
    cfg = config(eps_clip_high=0.28, eps_clip_c=3.0, loss_agg_mode="seq-mean-token-mean",
                 use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3", entropy_coef=0.01)
    loss32, _ = policy_loss(as_batch(packed, dtype=torch.float32), cfg)
    loss64, _ = policy_loss(as_batch(packed), cfg)
    ratios = ref_ratios(packed, packed.old_log_probs, "ppo")
    pg = np.array([ref_surrogate(r, a, 0.2, 0.28, 3.0)[0] for r, a in zip(ratios, packed.advantages)])
    kl = np.array([ref_k3(a, b) for a, b in zip(packed.log_probs, packed.ref_log_probs)])
    expected = (ref_reduce(pg, packed, "seq-mean-token-mean") - 0.01 * ref_reduce(packed.entropy, packed, "seq-mean-token-mean")
                + 0.1 * ref_reduce(kl, packed, "seq-mean-token-mean"))
    assert loss32.dtype == torch.float32
    assert loss32.item() == pytest.approx(expected, abs=1e-5, rel=1e-5)
    assert loss64.item() == pytest.approx(expected, abs=1e-10, rel=1e-10)


def test_errors(packed):
    with pytest.raises(ValueError, match="eps_clip_c"):
        policy_loss(as_batch(packed), config(eps_clip_c=0.9))
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        policy_loss(as_batch(packed), config(loss_agg_mode="batch_mean"))
    with pytest.raises(ValueError, match="ref_log_probs"):
        policy_loss(as_batch(packed, ref_log_probs=None), config(use_kl_loss=True))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(as_batch(packed, entropy=None), config(entropy_coef=0.1))
    with pytest.raises(ValueError, match="rollout_log_probs"):
        policy_loss(as_batch(packed, rollout_log_probs=None), config(use_tis=True))
    with pytest.raises(ValueError, match="response_lengths"):
        as_batch(packed, response_lengths=[1, 2])
    with pytest.raises(ValueError, match="advantages"):
        as_batch(packed, advantages=torch.zeros(3))
