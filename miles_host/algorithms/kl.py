"""Per-token KL estimators between the policy and a reference policy.

The estimators are Schulman's (http://joschu.net/blog/kl-approx.html), spelled as
slime's ``compute_approx_kl`` spells them (``--kl-loss-type``), with tokens sampled
from the policy: ``log_ratio = log_probs - ref_log_probs``.

- ``k1``: ``log_ratio`` (unbiased, can be negative, high variance).
- ``k2``: ``log_ratio ** 2 / 2`` (biased, non-negative).
- ``k3``: ``exp(-log_ratio) - 1 + log_ratio`` (unbiased, non-negative, low variance).
- ``low_var_kl``: ``k3`` clamped to ``[-10, 10]`` for numerical safety.

With ``importance_ratio`` (slime's ``--use-unbiased-kl``, DeepSeek-V3.2) each token's
estimate is multiplied by ``pi_theta / pi_old`` so that the estimate stays unbiased
when the tokens were sampled from the old policy; as in slime the clamp of
``low_var_kl`` is applied after that multiplication.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

KLEstimator = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

LOW_VAR_KL_BOUND = 10.0


def _at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    # slime computes KL in float32; float64 stays float64 so tests can be exact.
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def _log_ratio(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return _at_least_float32(log_probs) - _at_least_float32(ref_log_probs)


def _weighted(kl: torch.Tensor, importance_ratio: torch.Tensor | None) -> torch.Tensor:
    return kl if importance_ratio is None else importance_ratio * kl


def kl_k1(log_probs, ref_log_probs, importance_ratio=None) -> torch.Tensor:
    """``k1 = log p - log p_ref`` per token."""
    return _weighted(_log_ratio(log_probs, ref_log_probs), importance_ratio)


def kl_k2(log_probs, ref_log_probs, importance_ratio=None) -> torch.Tensor:
    """``k2 = (log p - log p_ref) ** 2 / 2`` per token."""
    return _weighted(_log_ratio(log_probs, ref_log_probs) ** 2 / 2.0, importance_ratio)


def kl_k3(log_probs, ref_log_probs, importance_ratio=None) -> torch.Tensor:
    """``k3 = p_ref/p - 1 - log(p_ref/p)`` per token."""
    reverse_log_ratio = -_log_ratio(log_probs, ref_log_probs)
    return _weighted(reverse_log_ratio.exp() - 1 - reverse_log_ratio, importance_ratio)


def kl_low_var(log_probs, ref_log_probs, importance_ratio=None) -> torch.Tensor:
    """``k3`` (times the importance ratio, if any) clamped to ``[-10, 10]`` as slime does."""
    kl = kl_k3(log_probs, ref_log_probs, importance_ratio)
    return kl.clamp(min=-LOW_VAR_KL_BOUND, max=LOW_VAR_KL_BOUND)


#: ``--kl-loss-type`` -> estimator ``fn(log_probs, ref_log_probs, importance_ratio=None)``.
KL_ESTIMATORS: dict[str, KLEstimator] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "low_var_kl": kl_low_var,
}


def compute_approx_kl(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    kl_type: str,
    importance_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate of type ``kl_type`` (a key of ``KL_ESTIMATORS``)."""
    try:
        estimator = KL_ESTIMATORS[kl_type]
    except KeyError:
        raise ValueError(
            f"unknown KL type {kl_type!r}; choose one of {sorted(KL_ESTIMATORS)}"
        ) from None
    return estimator(log_probs, ref_log_probs, importance_ratio)
