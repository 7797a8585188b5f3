"""Off-policy corrections between training-side and rollout-side log-probs.

The rollout engine samples from ``pi_rollout``; the trainer recomputes
``pi_train`` (its "old" log-probs). Any mismatch (kernels, precision, batch shape)
makes the data slightly off-policy. A correction turns the two into per-token
``weights`` that multiply the policy-gradient loss and a ``mask`` that removes
tokens from its numerator (denominators keep the original loss mask, as slime's
"decoupled IS and rejection" does). Each correction is
``fn(train_log_probs, rollout_log_probs, loss_mask, response_lengths, config)
-> CorrectionResult``; all inputs are flat ``[N]`` tensors over packed responses,
and weights and masks never carry gradient.

- ``tis`` (slime ``vanilla_tis_function``, ``--use-tis``): ``ratio = exp(train - rollout)``
  clamped to ``[tis_clip_low, tis_clip]`` (``--tis-threshold`` is another spelling of
  ``--tis-clip``).
- ``mis`` (slime ``examples/train_infer_mismatch_helper/mis.py``, ``--use-mis``): the
  log-ratio at ``mis_level`` ``token`` (per token), ``sequence`` (sum over the
  sequence's loss-masked tokens: the product of ratios) or ``geometric`` (their mean:
  the geometric mean of ratios), clamped to +-20 before ``exp``; then ``mis_mode``
  ``truncate`` (weight capped at ``mis_upper_bound``), ``clip`` (weight clamped to
  ``[mis_lower_bound, mis_upper_bound]``) or ``mask`` (weight kept, mask zeroed outside
  that range). With ``mis_veto_threshold``
  a sequence with any loss-masked token ratio below it is masked out entirely.
- ``icepop`` (slime ``icepop_function``, ``--use-icepop``): tokens whose ratio lies
  outside ``[tis_clip_low, tis_clip]`` are masked out; the others keep the ratio as
  weight, as in IcePop's ``M(k) = k if alpha <= k <= beta else 0``.

Metrics are floats: fractions and means over loss-masked tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from miles_host.algorithms.masked_ops import (
    broadcast_to_tokens,
    check_packed,
    masked_mean,
    per_sequence_masked_mean,
    per_sequence_sum,
)
from miles_host.records import Correction

#: slime's SAFETY_BOUND: log-ratios are clamped to +-20 before exp in MIS.
LOG_RATIO_SAFETY_BOUND = 20.0


@dataclass(frozen=True)
class CorrectionResult:
    """Per-token ``weights`` ``[N]`` and ``mask`` ``[N]`` (both detached) and metrics (detached 0-dim
    tensors, or floats: the trainer reads them all with one host sync per step)."""

    weights: torch.Tensor
    mask: torch.Tensor
    metrics: dict[str, torch.Tensor | float] = field(default_factory=dict)


def _fraction(condition_N: torch.Tensor, loss_mask_N: torch.Tensor) -> torch.Tensor:
    return masked_mean(condition_N.to(loss_mask_N.dtype), loss_mask_N).detach()


def _prepare(train_log_probs, rollout_log_probs, loss_mask, response_lengths):
    if train_log_probs.shape != rollout_log_probs.shape or train_log_probs.shape != loss_mask.shape:
        raise ValueError(
            f"train_log_probs {tuple(train_log_probs.shape)}, rollout_log_probs "
            f"{tuple(rollout_log_probs.shape)} and loss_mask {tuple(loss_mask.shape)} must match"
        )
    check_packed(response_lengths, train_log_probs.numel())
    log_ratio = train_log_probs.detach() - rollout_log_probs.detach()
    return log_ratio, loss_mask.detach().to(log_ratio.dtype)


# ----------------------------------------------------------------------------
# always-on mismatch metrics
# ----------------------------------------------------------------------------


def mismatch_metrics(
    train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, loss_mask: torch.Tensor
) -> dict[str, float]:
    """How far training and rollout log-probs disagree, over loss-masked tokens.

    - ``train_rollout_logprob_abs_diff``: mean ``|train - rollout|`` (slime's metric).
    - ``train_rollout_kl``: mean k3 estimate of ``KL(pi_rollout || pi_train)`` with
      tokens sampled from the rollout policy: ``exp(d) - 1 - d``, ``d = train - rollout``
      (slime's ``k3_kl`` in mis.py); non-negative, 0 iff the two agree.
    - ``train_rollout_k1``: mean ``rollout - train`` (slime's ``kl``; unbiased, signed).
    - ``train_rollout_logprob_abs_diff_max``: the largest ``|train - rollout|``.
    """
    log_ratio, mask = _prepare(train_log_probs, rollout_log_probs, loss_mask, [loss_mask.numel()])
    abs_diff = log_ratio.abs()
    # masked-out tokens count as 0 (|d| >= 0): the max over kept tokens, 0 when none is kept
    kept_abs_diff = torch.where(mask > 0, abs_diff, torch.zeros_like(abs_diff))
    return {
        "train_rollout_logprob_abs_diff": masked_mean(abs_diff, mask).detach(),
        "train_rollout_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask).detach(),
        "train_rollout_k1": masked_mean(-log_ratio, mask).detach(),
        "train_rollout_logprob_abs_diff_max": (
            kept_abs_diff.amax().detach() if kept_abs_diff.numel() else abs_diff.new_zeros(())
        ),
    }


# ----------------------------------------------------------------------------
# TIS and IcePop
# ----------------------------------------------------------------------------


def tis_bounds(config) -> tuple[float, float]:
    """``(tis_clip_low, tis_clip)`` (``--tis-threshold`` is another spelling of ``--tis-clip``)."""
    return config.tis_clip_low, config.tis_clip


def tis_correction(train_log_probs, rollout_log_probs, loss_mask, response_lengths, config) -> CorrectionResult:
    """Truncated importance sampling: weight ``clamp(exp(train - rollout), low, high)``; with
    ``--tis-level sequence`` / ``geometric`` the log-ratio is first the sequence's sum / mean
    (as ``mis_level``), clamped to +-20 before ``exp``."""
    log_ratio, mask = _prepare(train_log_probs, rollout_log_probs, loss_mask, response_lengths)
    low, high = tis_bounds(config)
    level = config.tis_level
    if level != "token":
        level_ratio = _lookup(MIS_LEVELS, "tis_level", level)(log_ratio, mask, response_lengths)
        log_ratio = level_ratio.clamp(-LOG_RATIO_SAFETY_BOUND, LOG_RATIO_SAFETY_BOUND)
    ratio = log_ratio.exp()
    weights = ratio.clamp(min=low, max=high)
    metrics = {
        "tis_ratio_mean": masked_mean(ratio, mask).detach(),
        "tis_clipfrac": _fraction(weights != ratio, mask),
        "tis_abs": masked_mean((ratio - 1).abs(), mask).detach(),
    }
    return CorrectionResult(weights, mask, metrics)


def icepop_correction(train_log_probs, rollout_log_probs, loss_mask, response_lengths, config) -> CorrectionResult:
    """IcePop: keep the ratio as weight inside ``[tis_clip_low, tis_clip]``, mask tokens outside."""
    log_ratio, mask = _prepare(train_log_probs, rollout_log_probs, loss_mask, response_lengths)
    low, high = tis_bounds(config)
    ratio = log_ratio.exp()
    inside = (ratio >= low) & (ratio <= high)
    metrics = {
        "icepop_ratio_mean": masked_mean(ratio, mask).detach(),
        "icepop_mask_fraction": _fraction(~inside, mask),
    }
    return CorrectionResult(ratio, mask * inside.to(mask.dtype), metrics)


# ----------------------------------------------------------------------------
# MIS: levels, modes, veto
# ----------------------------------------------------------------------------


def token_log_ratio(log_ratio_N, mask_N, response_lengths) -> torch.Tensor:
    """Each token's own log-ratio."""
    return log_ratio_N


def sequence_log_ratio(log_ratio_N, mask_N, response_lengths) -> torch.Tensor:
    """Sum of the sequence's loss-masked log-ratios (log of the product of ratios), per token."""
    return broadcast_to_tokens(per_sequence_sum(log_ratio_N * mask_N, response_lengths), response_lengths)


def geometric_log_ratio(log_ratio_N, mask_N, response_lengths) -> torch.Tensor:
    """Mean of the sequence's loss-masked log-ratios (log of the geometric mean), per token."""
    return broadcast_to_tokens(per_sequence_masked_mean(log_ratio_N, mask_N, response_lengths), response_lengths)


#: ``mis_level`` -> ``fn(log_ratio, loss_mask, response_lengths) -> log-ratio per token``.
MIS_LEVELS: dict[str, Callable[..., torch.Tensor]] = {
    "token": token_log_ratio,
    "sequence": sequence_log_ratio,
    "geometric": geometric_log_ratio,
}


def truncate_mode(weights, mask, lower, upper):
    """Cap the weight at ``upper``; the mask is untouched (TIS-style)."""
    return weights.clamp(max=upper), mask, {"mis_truncate_fraction": _fraction(weights > upper, mask)}


def clip_mode(weights, mask, lower, upper):
    """Clamp the weight into ``[lower, upper]``; the mask is untouched."""
    metrics = {
        "mis_clip_fraction_low": _fraction(weights < lower, mask),
        "mis_clip_fraction_high": _fraction(weights > upper, mask),
    }
    return weights.clamp(min=lower, max=upper), mask, metrics


def mask_mode(weights, mask, lower, upper):
    """Keep the weight, mask out tokens whose weight is outside ``[lower, upper]``."""
    inside = (weights >= lower) & (weights <= upper)
    metrics = {
        "mis_mask_fraction_low": _fraction(weights < lower, mask),
        "mis_mask_fraction_high": _fraction(weights > upper, mask),
    }
    return weights, mask * inside.to(mask.dtype), metrics


#: ``mis_mode`` -> ``fn(weights, mask, lower, upper) -> (weights, mask, metrics)``.
MIS_MODES: dict[str, Callable[..., tuple]] = {
    "truncate": truncate_mode,
    "clip": clip_mode,
    "mask": mask_mode,
}


def veto_mask(log_ratio_N, mask_N, response_lengths, veto_threshold: float) -> torch.Tensor:
    """0 on every token of a sequence holding a loss-masked token with ratio < ``veto_threshold``."""
    catastrophic_N = ((log_ratio_N < math.log(veto_threshold)) & (mask_N > 0)).to(mask_N.dtype)
    vetoed_S = per_sequence_sum(catastrophic_N, response_lengths) > 0
    return broadcast_to_tokens((~vetoed_S).to(mask_N.dtype), response_lengths)


def _lookup(registry: dict, kind: str, name: str):
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; choose one of {sorted(registry)}") from None


def mis_correction(train_log_probs, rollout_log_probs, loss_mask, response_lengths, config) -> CorrectionResult:
    """Masked/truncated importance sampling at a token, sequence or geometric level."""
    log_ratio, mask = _prepare(train_log_probs, rollout_log_probs, loss_mask, response_lengths)
    level = _lookup(MIS_LEVELS, "mis_level", config.mis_level)
    mode = _lookup(MIS_MODES, "mis_mode", config.mis_mode)
    upper, lower = config.mis_upper_bound, config.mis_lower_bound
    level_log_ratio = level(log_ratio, mask, response_lengths)
    raw_weights = level_log_ratio.clamp(-LOG_RATIO_SAFETY_BOUND, LOG_RATIO_SAFETY_BOUND).exp()
    weights, new_mask, metrics = mode(raw_weights, mask, lower, upper)
    metrics = {"mis_ratio_mean": masked_mean(raw_weights, mask).detach(), **metrics}
    veto_threshold = config.mis_veto_threshold
    if veto_threshold is not None:
        keep = veto_mask(log_ratio, mask, response_lengths, veto_threshold)
        metrics["mis_veto_token_fraction"] = _fraction(keep == 0, mask)
        new_mask = new_mask * keep
    return CorrectionResult(weights, new_mask, metrics)


CorrectionFn = Callable[..., CorrectionResult]

#: the host's corrections (``miles_host.builtin.corrections`` registers them): what each
#: computes and which flag switches it on. The records are the one place that says so.
CORRECTION_RECORDS: tuple[Correction, ...] = (
    Correction("tis", "truncated importance sampling (--use-tis)", fn=tis_correction, enabled=lambda c: c.use_tis),
    Correction("mis", "masked importance sampling (--use-mis)", fn=mis_correction, enabled=lambda c: c.use_mis),
    Correction(
        "icepop", "mask tokens with extreme ratios (--use-icepop)", fn=icepop_correction, enabled=lambda c: c.use_icepop
    ),
)

#: correction name -> ``fn(train_log_probs, rollout_log_probs, loss_mask, response_lengths, config)``.
CORRECTIONS: dict[str, CorrectionFn] = {record.name: record.fn for record in CORRECTION_RECORDS}


def enabled_corrections(config) -> list[CorrectionFn]:
    """The built-in corrections whose record is ``enabled`` by ``config`` (the host instead
    applies every registered correction record that is, plugins' included)."""
    return [record.fn for record in CORRECTION_RECORDS if record.enabled(config)]


def apply_corrections(
    corrections: Sequence[CorrectionFn],
    train_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    response_lengths: Sequence[int],
    config,
) -> CorrectionResult:
    """Run several corrections; their weights and masks multiply, their metrics merge."""
    weights = torch.ones_like(train_log_probs, dtype=torch.promote_types(train_log_probs.dtype, torch.float32))
    mask = loss_mask.detach().to(weights.dtype)
    metrics: dict[str, float] = {}
    for correction in corrections:
        result = correction(train_log_probs, rollout_log_probs, loss_mask, response_lengths, config)
        weights = weights * result.weights
        mask = mask * result.mask
        metrics.update(result.metrics)
    return CorrectionResult(weights.detach(), mask.detach(), metrics)
