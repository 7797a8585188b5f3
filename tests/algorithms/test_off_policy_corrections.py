"""TIS / MIS / IcePop corrections and mismatch metrics against python-loop references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from miles_host.config import MilesConfig
from miles_host.algorithms.corrections import (
    CORRECTIONS,
    MIS_LEVELS,
    MIS_MODES,
    CorrectionResult,
    apply_corrections,
    enabled_corrections,
    mismatch_metrics,
)


def run(name, p, dtype=torch.float64, **flags):
    t = lambda a: torch.tensor(a, dtype=dtype)  # noqa: E731
    return CORRECTIONS[name](
        t(p.old_log_probs), t(p.rollout_log_probs), t(p.loss_mask), p.lengths, MilesConfig(**flags)
    )


def masked_fraction(condition, mask):
    return sum(float(c) * m for c, m in zip(condition, mask)) / sum(mask)


def ref_level_log_ratios(p, level):
    """Per-token log-ratio at ``level`` with python loops."""
    out = []
    for seg in p.segments():
        diffs = [a - b for a, b in zip(p.old_log_probs[seg], p.rollout_log_probs[seg])]
        mask = p.loss_mask[seg]
        if level == "token":
            out += diffs
            continue
        total = sum(d * m for d, m in zip(diffs, mask))
        value = total if level == "sequence" else total / max(sum(mask), 1)
        out += [value] * len(diffs)
    return out


def ref_veto_keep(p, threshold):
    keep = []
    for seg in p.segments():
        bad = any(
            math.exp(a - b) < threshold and m > 0
            for a, b, m in zip(p.old_log_probs[seg], p.rollout_log_probs[seg], p.loss_mask[seg])
        )
        keep += [0.0 if bad else 1.0] * (seg.stop - seg.start)
    return keep


def test_registries():
    assert set(CORRECTIONS) == {"tis", "mis", "icepop"}
    assert set(MIS_LEVELS) == {"token", "sequence", "geometric"}
    assert set(MIS_MODES) == {"truncate", "mask", "clip"}


@pytest.mark.parametrize("flags,low,high", [
    (dict(tis_clip=1.5, tis_clip_low=0.7), 0.7, 1.5),
    (dict(tis_clip=0.9, tis_clip_low=0.0), 0.0, 0.9),  # --tis-threshold 0.9 is this --tis-clip
    (dict(), 0.0, 2.0),
])
def test_tis(packed, flags, low, high):
    result = run("tis", packed, **flags)
    ratios = [math.exp(a - b) for a, b in zip(packed.old_log_probs, packed.rollout_log_probs)]
    weights = [min(max(r, low), high) for r in ratios]
    assert isinstance(result, CorrectionResult)
    np.testing.assert_allclose(result.weights.numpy(), weights, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(result.mask.numpy(), packed.loss_mask)
    clipped = [w != r for w, r in zip(weights, ratios)]
    assert result.metrics["tis_clipfrac"] == pytest.approx(masked_fraction(clipped, packed.loss_mask), abs=1e-12)
    assert 0 < result.metrics["tis_clipfrac"] < 1


def test_icepop(packed):
    result = run("icepop", packed, tis_clip=1.5, tis_clip_low=0.6)
    ratios = [math.exp(a - b) for a, b in zip(packed.old_log_probs, packed.rollout_log_probs)]
    inside = [0.6 <= r <= 1.5 for r in ratios]
    np.testing.assert_allclose(result.weights.numpy(), ratios, rtol=1e-10)
    np.testing.assert_array_equal(result.mask.numpy(), [m * i for m, i in zip(packed.loss_mask, inside)])
    expected = masked_fraction([not i for i in inside], packed.loss_mask)
    assert result.metrics["icepop_mask_fraction"] == pytest.approx(expected, abs=1e-12)
    assert 0 < expected < 1


# bounds per level: the sequence product spreads widely, the geometric mean barely moves
BOUNDS = {"token": (0.6, 1.5), "sequence": (0.3, 3.0), "geometric": (0.9, 1.1)}


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask", "clip"])
@pytest.mark.parametrize("veto", [None, 0.4])
def test_mis(packed, level, mode, veto):
    lower, upper = BOUNDS[level]
    result = run("mis", packed, mis_level=level, mis_mode=mode, mis_lower_bound=lower,
                 mis_upper_bound=upper, mis_veto_threshold=veto)
    raw = [math.exp(min(max(x, -20.0), 20.0)) for x in ref_level_log_ratios(packed, level)]
    mask = list(packed.loss_mask)
    if mode == "truncate":
        weights = [min(w, upper) for w in raw]
    elif mode == "clip":
        weights = [min(max(w, lower), upper) for w in raw]
    else:
        weights = raw
        mask = [m * float(lower <= w <= upper) for m, w in zip(mask, raw)]
    if veto is not None:
        keep = ref_veto_keep(packed, veto)
        assert 0 in keep and 1 in keep
        mask = [m * k for m, k in zip(mask, keep)]
    np.testing.assert_allclose(result.weights.numpy(), weights, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(result.mask.numpy(), mask)
    assert result.metrics["mis_ratio_mean"] == pytest.approx(
        sum(w * m for w, m in zip(raw, packed.loss_mask)) / sum(packed.loss_mask), rel=1e-10
    )
    if mode == "truncate":
        expected = masked_fraction([w > upper for w in raw], packed.loss_mask)
        assert result.metrics["mis_truncate_fraction"] == pytest.approx(expected, abs=1e-12)
    if mode == "mask":
        expected = masked_fraction([w > upper for w in raw], packed.loss_mask)
        assert result.metrics["mis_mask_fraction_high"] == pytest.approx(expected, abs=1e-12)
    if veto is not None:
        expected = masked_fraction([k == 0 for k in keep], packed.loss_mask)
        assert result.metrics["mis_veto_token_fraction"] == pytest.approx(expected, abs=1e-12)


def test_mis_defaults_and_overflow_guard(packed):
    packed.old_log_probs[3] += 60.0  # exp(60) would blow up a sequence product without the bound
    result = run("mis", packed, mis_level="sequence", mis_upper_bound=4.0, mis_mode="mask")
    assert torch.isfinite(result.weights).all()
    raw = [math.exp(min(max(x, -20.0), 20.0)) for x in ref_level_log_ratios(packed, "sequence")]
    inside = [0.5 <= w <= 4.0 for w in raw]  # --mis-lower-bound's default
    np.testing.assert_array_equal(result.mask.numpy(), [m * i for m, i in zip(packed.loss_mask, inside)])


def test_float32(packed):
    result = run("mis", packed, dtype=torch.float32, mis_level="geometric", mis_mode="truncate", mis_upper_bound=1.05)
    raw = [math.exp(x) for x in ref_level_log_ratios(packed, "geometric")]
    np.testing.assert_allclose(result.weights.numpy(), [min(w, 1.05) for w in raw], rtol=1e-5, atol=1e-5)


def test_mismatch_metrics(packed):
    t = torch.tensor
    got = mismatch_metrics(t(packed.old_log_probs), t(packed.rollout_log_probs), t(packed.loss_mask))
    kept = [(a, b) for a, b, m in zip(packed.old_log_probs, packed.rollout_log_probs, packed.loss_mask) if m > 0]
    count = len(kept)
    assert got["train_rollout_logprob_abs_diff"] == pytest.approx(sum(abs(a - b) for a, b in kept) / count, rel=1e-10)
    k3 = sum(math.exp(a - b) - 1 - (a - b) for a, b in kept) / count
    assert got["train_rollout_kl"] == pytest.approx(k3, rel=1e-10)
    assert got["train_rollout_k1"] == pytest.approx(sum(b - a for a, b in kept) / count, rel=1e-10)
    assert got["train_rollout_logprob_abs_diff_max"] == pytest.approx(max(abs(a - b) for a, b in kept))
    same = mismatch_metrics(t(packed.old_log_probs), t(packed.old_log_probs), t(packed.loss_mask))
    assert same["train_rollout_logprob_abs_diff"] == 0.0 and same["train_rollout_kl"] == 0.0


def test_enabled_and_combined(packed):
    cfg = MilesConfig(use_tis=True, use_mis=True, tis_clip=1.5, mis_mode="mask", mis_upper_bound=1.5)
    assert enabled_corrections(cfg) == [CORRECTIONS["tis"], CORRECTIONS["mis"]]
    assert enabled_corrections(MilesConfig()) == []
    t = torch.tensor
    combined = apply_corrections(enabled_corrections(cfg), t(packed.old_log_probs), t(packed.rollout_log_probs),
                                 t(packed.loss_mask), packed.lengths, cfg)
    tis = run("tis", packed, tis_clip=1.5)
    mis = run("mis", packed, mis_mode="mask", mis_upper_bound=1.5)
    np.testing.assert_allclose(combined.weights.numpy(), (tis.weights * mis.weights).numpy(), rtol=1e-12)
    np.testing.assert_array_equal(combined.mask.numpy(), (tis.mask * mis.mask).numpy())
    assert {"tis_clipfrac", "mis_mask_fraction_low"} <= set(combined.metrics)


def test_errors(packed):
    with pytest.raises(ValueError, match="geometric"):
        run("mis", packed, mis_level="batch")
    with pytest.raises(ValueError, match="truncate"):
        run("mis", packed, mis_mode="reject")
    with pytest.raises(ValueError, match="must match"):
        CORRECTIONS["tis"](torch.zeros(3), torch.zeros(4), torch.ones(3), [3], MilesConfig())
    with pytest.raises(ValueError, match="response_lengths"):
        CORRECTIONS["tis"](torch.zeros(3), torch.zeros(3), torch.ones(3), [2], MilesConfig())


def test_veto_ignores_masked_out_tokens(packed):
    start = packed.starts()[4]
    packed.loss_mask[start + 2] = 0.0  # a tool-output token far off-policy must not veto
    packed.old_log_probs[start + 2] = packed.rollout_log_probs[start + 2] - 30.0
    packed.old_log_probs[start + 3] = packed.rollout_log_probs[start + 3] - 30.0
    packed.loss_mask[start + 3] = 0.0
    masked_only = run("mis", packed, mis_veto_threshold=1e-4, mis_upper_bound=1e9)
    np.testing.assert_array_equal(masked_only.mask.numpy(), packed.loss_mask)
    packed.loss_mask[start + 3] = 1.0
    vetoed = run("mis", packed, mis_veto_threshold=1e-4, mis_upper_bound=1e9)
    assert vetoed.mask[start : start + packed.lengths[4]].sum() == 0
