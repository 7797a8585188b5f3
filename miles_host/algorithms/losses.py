"""Policy loss over the packed response tokens of one micro-batch.

All per-token tensors are flat ``[N]``: the responses of the micro-batch
concatenated, ``response_lengths`` saying where each ends. Semantics follow slime's
``policy_loss_function`` (``slime/backends/megatron_utils/loss.py``) and
``compute_policy_loss`` / ``compute_gspo_kl`` / ``compute_cispo_loss``
(``slime/utils/ppo_utils.py``):

- ``ppo_kl = old_log_probs - log_probs``, ``ratio = exp(-ppo_kl)``.
- PPO clip: ``max(-ratio * A, -clamp(ratio, 1 - eps_clip, 1 + eps_clip_high) * A)``;
  ``pg_clipfrac`` counts tokens where the clipped term wins.
- Dual clip (``eps_clip_c > 1``, arXiv:1912.09729): for ``A < 0`` the loss is further
  capped at ``-eps_clip_c * A``; ``dual_clipfrac`` counts tokens where the cap wins.
- GSPO (``--advantage-estimator gspo``): ``ppo_kl`` is the per-sequence masked mean of
  ``old - new`` broadcast over the sequence, so the ratio is the geometric mean of
  the token ratios; clipped with the same flags (GSPO's paper uses ~3e-4/4e-4).
- CISPO: ``-sg(clamp(ratio, 1 - eps_clip, 1 + eps_clip_high)) * A * log_probs``.

Reduction (``LOSS_AGGREGATIONS``, ``--loss-agg-mode``, verl's names): ``token-mean``
(sum over masked tokens / their count), ``seq-mean-token-mean`` (mean over sequences of
each sequence's masked mean), ``seq-mean-token-sum`` (mean over sequences of each
sequence's masked sum) or ``token-sum`` (the masked sum). Unset, it follows slime:
``token-mean`` with ``--calculate-per-token-loss``, else ``seq-mean-token-mean``. The
``normalizer`` argument of :func:`policy_loss` (a fixed constant, e.g. the step's global
token or sequence count for gradient accumulation) replaces the micro-batch's own count
in the denominator of the loss; metrics always use the micro-batch's own count, and
the mean-type counterpart of a summing mode (``token-sum`` reports token means,
``seq-mean-token-sum`` sequence means), so clip fractions stay fractions.

:func:`sft_loss` (``--loss-type sft_loss``) is slime's ``sft_loss_function``: the negative
log-likelihood of the loss-masked tokens under the same reductions. :func:`sum_of_sample_mean`
and :func:`micro_batch_count` give slime-contract functions (a custom loss, a policy-loss
reducer) slime's micro-batch sum and the count that turns it into the mean the trainer weights.

Config fields read: ``eps_clip``, ``eps_clip_high`` (None: ``eps_clip``), ``eps_clip_c``,
``advantage_estimator`` (picks the loss in ``POLICY_LOSSES``, PPO clip otherwise),
``use_kl_loss``, ``kl_loss_coef``, ``kl_loss_type``, ``use_unbiased_kl``,
``entropy_coef``, ``use_rollout_logprobs``, ``loss_agg_mode``,
``calculate_per_token_loss`` and the correction flags of ``corrections.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from miles_host.algorithms.corrections import (
    CorrectionFn,
    apply_corrections,
    enabled_corrections,
    mismatch_metrics,
)
from miles_host.algorithms.kl import compute_approx_kl
from miles_host.algorithms.masked_ops import broadcast_to_tokens, check_packed, per_sequence_masked_mean


@dataclass(frozen=True)
class PolicyLossBatch:
    """The flat ``[N]`` tensors of one micro-batch.

    ``log_probs`` carries gradient. ``old_log_probs`` (trainer-recomputed, None: the
    detached ``log_probs``, i.e. one on-policy step), ``rollout_log_probs`` (needed by
    corrections and ``use_rollout_logprobs``), ``ref_log_probs`` (needed by
    ``use_kl_loss``) and ``entropy`` (needed by ``entropy_coef != 0``) are optional.
    """

    log_probs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    response_lengths: Sequence[int]
    old_log_probs: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_packed(self.response_lengths, self.log_probs.numel())
        for name in ("advantages", "loss_mask", "old_log_probs", "rollout_log_probs", "ref_log_probs", "entropy"):
            tensor = getattr(self, name)
            if tensor is not None and tensor.shape != self.log_probs.shape:
                raise ValueError(f"{name} {tuple(tensor.shape)} must match log_probs {tuple(self.log_probs.shape)}")


@dataclass(frozen=True)
class PolicyLossTerms:
    """Per-token ``losses``, ``clipfrac`` and ``ppo_kl``, plus further per-token metrics."""

    losses: torch.Tensor
    clipfrac: torch.Tensor
    ppo_kl: torch.Tensor
    extra: Mapping[str, torch.Tensor] = field(default_factory=dict)


# ----------------------------------------------------------------------------
# aggregation
# ----------------------------------------------------------------------------


def token_mean(values, loss_mask, response_lengths, normalizer: float | None = None) -> torch.Tensor:
    """``sum(x * m) / normalizer``; ``normalizer`` defaults to ``max(sum(m), 1)``."""
    total = (values * loss_mask).sum()
    return total / (loss_mask.to(values.dtype).sum().clamp_min(1) if normalizer is None else normalizer)


def sequence_mean(values, loss_mask, response_lengths, normalizer: float | None = None) -> torch.Tensor:
    """``sum_i(masked mean of sequence i) / normalizer``; ``normalizer`` defaults to ``max(S, 1)``."""
    total = per_sequence_masked_mean(values, loss_mask.to(values.dtype), response_lengths).sum()
    return total / (max(len(response_lengths), 1) if normalizer is None else normalizer)


def sequence_mean_token_sum(values, loss_mask, response_lengths, normalizer: float | None = None) -> torch.Tensor:
    """``sum_i(masked sum of sequence i) / normalizer``; ``normalizer`` defaults to ``max(S, 1)``."""
    total = (values * loss_mask).sum()
    return total / (max(len(response_lengths), 1) if normalizer is None else normalizer)


def token_sum(values, loss_mask, response_lengths, normalizer: float | None = None) -> torch.Tensor:
    """``sum(x * m)`` (divided by ``normalizer`` when one is given)."""
    total = (values * loss_mask).sum()
    return total if normalizer is None else total / normalizer


Aggregation = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class LossAggregation:
    """A reduction of per-token values to the loss, and what the step's loss averages over.

    ``unit`` (``token``, ``sequence`` or ``none``) says how micro-batch losses of one
    optimizer step combine: weighted by their share of the step's loss-masked tokens,
    of its sequences, or summed (see :func:`micro_batch_share`). ``metric`` names the
    mean-type aggregation that reports per-token metrics (clip fractions, KL, entropy,
    the policy-gradient term), so that they stay means whatever sums the loss takes.
    """

    reduce: Aggregation
    unit: str
    metric: str


#: ``--loss-agg-mode`` (verl's names) -> its reduction over a micro-batch.
LOSS_AGGREGATIONS: dict[str, LossAggregation] = {
    "token-mean": LossAggregation(token_mean, "token", "token-mean"),
    "seq-mean-token-mean": LossAggregation(sequence_mean, "sequence", "seq-mean-token-mean"),
    "seq-mean-token-sum": LossAggregation(sequence_mean_token_sum, "sequence", "seq-mean-token-mean"),
    "token-sum": LossAggregation(token_sum, "none", "token-mean"),
}


def aggregation_name(config) -> str:
    """``--loss-agg-mode``, or from slime's ``--calculate-per-token-loss`` when unset:
    ``token-mean`` with it, ``seq-mean-token-mean`` without (slime's two modes)."""
    if config.loss_agg_mode is not None:
        return config.loss_agg_mode
    return "token-mean" if config.calculate_per_token_loss else "seq-mean-token-mean"


def _aggregation(config) -> LossAggregation:
    name = aggregation_name(config)
    try:
        return LOSS_AGGREGATIONS[name]
    except KeyError:
        raise ValueError(f"unknown --loss-agg-mode {name!r}; choose one of {sorted(LOSS_AGGREGATIONS)}") from None


def aggregation_for(config) -> Aggregation:
    """The reducer of :func:`aggregation_name`."""
    return _aggregation(config).reduce


def metric_aggregation_for(config) -> Aggregation:
    """The mean-type reducer that reports per-token metrics under :func:`aggregation_name`."""
    return LOSS_AGGREGATIONS[_aggregation(config).metric].reduce


def micro_batch_share(
    config,
    micro_loss_masks: Sequence[Sequence[float]],
    step_loss_masks: Sequence[Sequence[float]],
    for_metrics: bool = False,
) -> float:
    """The weight of a micro-batch's loss in its optimizer step's loss, so that the weighted
    sum of micro-batch losses is the aggregation over the whole step: the micro-batch's
    share of the step's loss-masked tokens (``token-mean``), of its sequences
    (``seq-mean-*``), or 1 (``token-sum``). ``for_metrics``: the share under the metrics'
    aggregation (:func:`metric_aggregation_for`), which combines the micro-batch metrics."""
    aggregation = _aggregation(config)
    unit = LOSS_AGGREGATIONS[aggregation.metric].unit if for_metrics else aggregation.unit
    if unit == "token":
        return sum(map(sum, micro_loss_masks)) / (sum(map(sum, step_loss_masks)) or 1)
    if unit == "sequence":
        return len(micro_loss_masks) / max(len(step_loss_masks), 1)
    return 1.0


def micro_batch_count(config, loss_mask, response_lengths) -> float | torch.Tensor:
    """What ``--loss-agg-mode``'s reduction divides one micro-batch's sum by: its loss-masked
    tokens (``token-mean``, at least 1), its sequences (``seq-mean-*``) or 1 (``token-sum``)."""
    unit = _aggregation(config).unit
    if unit == "token":
        return loss_mask.sum().clamp_min(1)
    if unit == "sequence":
        return float(max(len(response_lengths), 1))
    return 1.0


def sum_of_sample_mean(config, loss_mask, response_lengths) -> Callable[[torch.Tensor], torch.Tensor]:
    """slime's ``sum_of_sample_mean`` over one micro-batch's flat ``[N]`` response values:
    ``--loss-agg-mode``'s reduction without its denominator (with ``--calculate-per-token-loss``
    the masked token sum, otherwise the sum of each sequence's masked mean). A loss built
    from it is a micro-batch sum, as slime's are; divide by :func:`micro_batch_count` for
    the micro-batch mean the trainer weights."""
    reduce = aggregation_for(config)
    mask = loss_mask

    def reducer(values: torch.Tensor) -> torch.Tensor:
        return reduce(values, mask.to(values.dtype), response_lengths, 1.0)

    return reducer


# ----------------------------------------------------------------------------
# policy-gradient terms
# ----------------------------------------------------------------------------


def clip_bounds(config) -> tuple[float, float, float | None]:
    """``(eps_clip, eps_clip_high, eps_clip_c)`` with ``eps_clip_high`` defaulting to ``eps_clip``."""
    eps_clip, eps_clip_high, eps_clip_c = config.eps_clip, config.eps_clip_high, config.eps_clip_c
    if eps_clip_c is not None and eps_clip_c <= 1.0:
        raise ValueError(f"eps_clip_c (dual-clip PPO) must be > 1.0, got {eps_clip_c}")
    return eps_clip, eps_clip if eps_clip_high is None else eps_clip_high, eps_clip_c


def clipped_surrogate(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> PolicyLossTerms:
    """PPO's clipped surrogate per token, with optional dual clip for negative advantages."""
    ratio = (-ppo_kl).exp()
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    losses = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).to(ratio.dtype)
    if eps_clip_c is None:
        return PolicyLossTerms(losses, clipfrac, ppo_kl)
    cap = -eps_clip_c * advantages
    negative = advantages < 0
    dual_clipfrac = (negative & (cap < losses)).to(ratio.dtype)
    losses = torch.where(negative, torch.minimum(cap, losses), losses)
    return PolicyLossTerms(losses, clipfrac, ppo_kl, {"dual_clipfrac": dual_clipfrac})


def ppo_policy_loss(log_probs, old_log_probs, advantages, loss_mask, response_lengths, config) -> PolicyLossTerms:
    """Token-level ratio ``exp(log_probs - old_log_probs)`` in the clipped surrogate."""
    return clipped_surrogate(old_log_probs - log_probs, advantages, *clip_bounds(config))


def gspo_policy_loss(log_probs, old_log_probs, advantages, loss_mask, response_lengths, config) -> PolicyLossTerms:
    """Sequence-level ratio: geometric mean of the token ratios over loss-masked tokens."""
    sequence_kl_S = per_sequence_masked_mean(old_log_probs - log_probs, loss_mask, response_lengths)
    return clipped_surrogate(broadcast_to_tokens(sequence_kl_S, response_lengths), advantages, *clip_bounds(config))


def cispo_policy_loss(log_probs, old_log_probs, advantages, loss_mask, response_lengths, config) -> PolicyLossTerms:
    """CISPO (MiniMax-M1): clipped ratio under stop-gradient times ``A * log_probs``."""
    eps_clip, eps_clip_high, _ = clip_bounds(config)
    ppo_kl = old_log_probs - log_probs
    ratio = (-ppo_kl).exp()
    truncated = ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    losses = -truncated.detach() * advantages * log_probs
    return PolicyLossTerms(losses, (truncated != ratio).to(ratio.dtype), ppo_kl)


PolicyLossFn = Callable[..., PolicyLossTerms]

#: advantage estimator -> its policy-gradient term; any other estimator uses ``ppo``.
POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo": ppo_policy_loss,
    "gspo": gspo_policy_loss,
    "cispo": cispo_policy_loss,
}


def policy_loss_for(config) -> PolicyLossFn:
    """The policy-gradient term of a built-in ``config.advantage_estimator`` (PPO clip by
    default), for callers without the estimator's record; the host passes the record's
    ``policy_loss`` to :func:`policy_loss` instead."""
    return POLICY_LOSSES.get(config.advantage_estimator, ppo_policy_loss)


# ----------------------------------------------------------------------------
# composition
# ----------------------------------------------------------------------------


def old_log_probs_for(batch: PolicyLossBatch, config) -> torch.Tensor:
    """The denominator of the PPO ratio: rollout, recomputed, or detached current log-probs."""
    if config.use_rollout_logprobs:
        if batch.rollout_log_probs is None:
            raise ValueError("use_rollout_logprobs needs batch.rollout_log_probs")
        return batch.rollout_log_probs.detach()
    if batch.old_log_probs is None:
        return batch.log_probs.detach()
    return batch.old_log_probs.detach()


def kl_loss_per_token(batch: PolicyLossBatch, old_log_probs: torch.Tensor, config) -> torch.Tensor:
    """Per-token KL to the reference (``kl_loss_type``), IS-weighted with ``use_unbiased_kl``."""
    if batch.ref_log_probs is None:
        raise ValueError("use_kl_loss needs batch.ref_log_probs (reference-model log-probs)")
    importance_ratio = None
    if config.use_unbiased_kl:
        importance_ratio = torch.exp(batch.log_probs - old_log_probs)
    return compute_approx_kl(
        batch.log_probs, batch.ref_log_probs.detach(), config.kl_loss_type, importance_ratio
    )


def _corrected_pg_losses(batch, pg_losses, corrections, config, metrics) -> torch.Tensor:
    if batch.rollout_log_probs is None:
        if corrections:
            raise ValueError("off-policy corrections need batch.rollout_log_probs")
        return pg_losses
    train_log_probs = (batch.log_probs if batch.old_log_probs is None else batch.old_log_probs).detach()
    metrics.update(mismatch_metrics(train_log_probs, batch.rollout_log_probs, batch.loss_mask))
    if not corrections:
        return pg_losses
    result = apply_corrections(
        corrections, train_log_probs, batch.rollout_log_probs, batch.loss_mask, batch.response_lengths, config
    )
    metrics.update(result.metrics)
    # the rejected tokens leave the numerator only; denominators keep the original mask
    return pg_losses * result.weights.to(pg_losses.dtype) * result.mask.to(pg_losses.dtype)


def policy_loss(
    batch: PolicyLossBatch,
    config,
    corrections: Sequence[CorrectionFn] | None = None,
    normalizer: float | None = None,
    pg_loss: PolicyLossFn | None = None,
    pg_reducer: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """Policy loss of one micro-batch: ``pg - entropy_coef * entropy + kl_loss_coef * kl``.

    ``pg_reducer`` (slime's ``--custom-pg-loss-reducer-function-path``) reduces the
    per-token policy-gradient term instead of ``--loss-agg-mode``'s reduction, slime's
    way: it returns the micro-batch's *sum* (of sequence means, or of tokens), which is
    divided here by the micro-batch's own count (:func:`micro_batch_count`) so that the
    trainer's micro-batch weighting makes the step's loss slime's. Metrics keep the
    default reduction.

    ``corrections`` defaults to the built-ins switched on in ``config``
    (:func:`~miles_host.algorithms.corrections.enabled_corrections`) and ``pg_loss`` to
    :func:`policy_loss_for`; the host passes the registry's enabled corrections and the
    advantage estimator record's ``policy_loss``. Returns the scalar loss and its metrics as detached 0-dim
    tensors (no host sync here: the trainer reads a whole step's metrics at once).
    """
    reduce, report = aggregation_for(config), metric_aggregation_for(config)
    mask, lengths = batch.loss_mask.to(batch.log_probs.dtype), batch.response_lengths
    old_log_probs = old_log_probs_for(batch, config)
    pg_term = pg_loss or policy_loss_for(config)
    terms = pg_term(batch.log_probs, old_log_probs, batch.advantages, mask, lengths, config)
    metrics: dict[str, torch.Tensor | float] = {}
    corrections = enabled_corrections(config) if corrections is None else list(corrections)
    pg_losses = _corrected_pg_losses(batch, terms.losses, corrections, config, metrics)

    if pg_reducer is not None:  # --custom-pg-loss-reducer-function-path: slime's sum over the micro-batch
        pg_loss = pg_reducer(pg_losses) / (normalizer or micro_batch_count(config, mask, lengths))
    else:
        pg_loss = reduce(pg_losses, mask, lengths, normalizer)
    loss = pg_loss
    metrics["pg_loss"] = report(pg_losses.detach(), mask, lengths).detach()
    metrics["pg_clipfrac"] = report(terms.clipfrac, mask, lengths).detach()
    metrics["ppo_kl"] = report(terms.ppo_kl.detach(), mask, lengths).detach()
    for name, values in terms.extra.items():
        metrics[name] = report(values, mask, lengths).detach()

    entropy_coef = config.entropy_coef
    if entropy_coef != 0 and batch.entropy is None:
        raise ValueError("entropy_coef != 0 needs batch.entropy")
    if batch.entropy is not None:
        loss = loss - entropy_coef * reduce(batch.entropy, mask, lengths, normalizer)
        metrics["entropy_loss"] = report(batch.entropy.detach(), mask, lengths).detach()

    if config.use_kl_loss:
        kl = kl_loss_per_token(batch, old_log_probs, config)
        loss = loss + config.kl_loss_coef * reduce(kl, mask, lengths, normalizer)
        metrics["kl_loss"] = report(kl.detach(), mask, lengths).detach()

    metrics["loss"] = loss.detach() if normalizer is None else _micro_batch_loss(metrics, config)
    return loss, metrics


def _micro_batch_loss(metrics: dict, config):
    # with a fixed normalizer the returned loss is a share of the step's loss; report
    # the micro-batch mean instead so that logged losses do not depend on batching.
    loss = metrics["pg_loss"] - config.entropy_coef * metrics.get("entropy_loss", 0.0)
    return loss + config.kl_loss_coef * metrics.get("kl_loss", 0.0)


# ----------------------------------------------------------------------------
# supervised fine-tuning
# ----------------------------------------------------------------------------


def sft_loss(batch: PolicyLossBatch, config, normalizer: float | None = None) -> tuple[torch.Tensor, dict]:
    """``--loss-type sft_loss`` (slime's ``sft_loss_function``): the negative log-likelihood
    of the loss-masked response tokens, reduced by ``--loss-agg-mode`` (slime: ``token-mean``
    with ``--calculate-per-token-loss``, else the mean over sequences of each one's masked
    mean). Advantages, old, rollout and reference log-probs are not read."""
    mask, lengths = batch.loss_mask.to(batch.log_probs.dtype), batch.response_lengths
    nll = -batch.log_probs
    loss = aggregation_for(config)(nll, mask, lengths, normalizer)
    metrics = {"sft_nll": metric_aggregation_for(config)(nll.detach(), mask, lengths).detach()}
    metrics["loss"] = loss.detach() if normalizer is None else metrics["sft_nll"]
    return loss, metrics
