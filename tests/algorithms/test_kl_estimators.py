"""KL estimators against per-element float64 formulas written out with ``math``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from miles_host.algorithms.kl import KL_ESTIMATORS, compute_approx_kl


def reference_kl(log_prob: float, ref_log_prob: float, kl_type: str, weight: float = 1.0) -> float:
    d = log_prob - ref_log_prob
    if kl_type == "k1":
        return weight * d
    if kl_type == "k2":
        return weight * d * d / 2
    k3 = weight * (math.exp(-d) - 1 + d)
    return min(max(k3, -10.0), 10.0) if kl_type == "low_var_kl" else k3


def test_registry_names():
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3", "low_var_kl"}


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3", "low_var_kl"])
@pytest.mark.parametrize("with_ratio", [False, True])
def test_matches_reference_float64(rng, kl_type, with_ratio):
    log_probs = -np.abs(rng.normal(size=200))
    ref = log_probs + 1.5 * rng.normal(size=200)
    ref[:5] = log_probs[:5] + np.array([-15.0, -12.0, 3.0, 12.0, 0.0])  # exercise the clamp
    ratio = np.exp(rng.normal(size=200) * 0.3) if with_ratio else np.ones(200)
    got = compute_approx_kl(
        torch.tensor(log_probs), torch.tensor(ref), kl_type, torch.tensor(ratio) if with_ratio else None
    )
    expected = [reference_kl(a, b, kl_type, w) for a, b, w in zip(log_probs, ref, ratio)]
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3", "low_var_kl"])
def test_float32_and_bfloat16_inputs_compute_in_float32(rng, kl_type):
    log_probs = -np.abs(rng.normal(size=64))
    ref = log_probs + 0.5 * rng.normal(size=64)
    as32 = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    got = compute_approx_kl(as32(log_probs), as32(ref), kl_type)
    expected = [reference_kl(float(np.float32(a)), float(np.float32(b)), kl_type) for a, b in zip(log_probs, ref)]
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-5)
    low = compute_approx_kl(torch.tensor(log_probs).bfloat16(), torch.tensor(ref).bfloat16(), kl_type)
    assert low.dtype == torch.float32


def test_low_var_kl_clamps_after_importance_ratio():
    log_probs, ref = torch.tensor([0.0], dtype=torch.float64), torch.tensor([3.0], dtype=torch.float64)
    k3 = math.exp(3.0) - 1 - 3.0  # ~16.1 before the clamp
    ratio = torch.tensor([0.5], dtype=torch.float64)
    assert compute_approx_kl(log_probs, ref, "low_var_kl", ratio).item() == pytest.approx(min(0.5 * k3, 10.0))
    assert compute_approx_kl(log_probs, ref, "low_var_kl").item() == 10.0


def test_unknown_type_names_choices():
    with pytest.raises(ValueError, match="low_var_kl"):
        compute_approx_kl(torch.zeros(2), torch.zeros(2), "k4")
