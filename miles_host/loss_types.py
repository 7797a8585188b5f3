"""``--loss-type``: what the trainer minimises on a micro-batch (slime's ``loss_function`` dispatch).

:data:`LOSS_TYPES` maps each name to a function ``(trainer, batch, loss_batch) -> (loss,
metrics)`` over one micro-batch: ``batch`` is the trainer's
:class:`~miles_host.trainer.PackedBatch`, ``loss_batch`` the
:class:`~miles_host.algorithms.losses.PolicyLossBatch` of its response tokens.

- ``policy_loss``: :func:`~miles_host.algorithms.losses.policy_loss` with the run's
  corrections and the estimator's policy-gradient term, its reduction replaced by
  ``--custom-pg-loss-reducer-function-path`` when given.
- ``sft_loss``: :func:`~miles_host.algorithms.losses.sft_loss`.
- ``custom_loss``: ``--custom-loss-function-path``, called with slime's signature
  ``fn(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)``. ``batch`` holds
  slime's keys for the micro-batch (``unconcat_tokens``, ``tokens``, ``total_lengths``,
  ``response_lengths``, ``loss_masks``, ``advantages``, ``log_probs`` (old policy),
  ``rollout_log_probs``, ``ref_log_probs`` where the run has them) and miles'
  ``miles_log_probs``: the current policy's response-token log-probs (``[N]``, with
  gradient). ``logits`` are the policy's ``[1, T, V]`` logits of the packed sequences,
  before the temperature (a second forward of the micro-batch). ``sum_of_sample_mean`` is
  slime's reducer (:func:`~miles_host.algorithms.losses.sum_of_sample_mean`); as in slime,
  the returned loss and metrics are micro-batch sums, which are divided here by the
  micro-batch's count so the trainer's weighting gives slime's step loss.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable

import torch

from miles_host.algorithms.losses import (
    PolicyLossBatch,
    micro_batch_count,
    policy_loss,
    ppo_policy_loss,
    sft_loss,
    sum_of_sample_mean,
)
from miles_host.reward import load_function

LossResult = tuple[torch.Tensor, dict]


@lru_cache(maxsize=8)
def _function(path: str, flag: str) -> Callable:
    return load_function(path, flag)


def pg_reducer_for(config: Any, batch: Any, loss_batch: PolicyLossBatch) -> Callable | None:
    """``--custom-pg-loss-reducer-function-path`` built for this micro-batch (slime's call:
    ``fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss)``), or None."""
    path = config.custom_pg_loss_reducer_function_path
    if not path:
        return None
    factory = _function(path, "--custom-pg-loss-reducer-function-path")
    lengths = list(loss_batch.response_lengths)
    masks = list(torch.split(loss_batch.loss_mask, lengths))
    bounds = batch.cu_seqlens.tolist()
    total_lengths = [end - start for start, end in zip(bounds, bounds[1:])]
    return factory(total_lengths, lengths, masks, bool(config.calculate_per_token_loss))


def policy_loss_type(trainer: Any, batch: Any, loss_batch: PolicyLossBatch) -> LossResult:
    """``--loss-type policy_loss``."""
    return policy_loss(loss_batch, trainer.config, corrections=trainer.corrections,
                       pg_loss=trainer.estimator.policy_loss or ppo_policy_loss,
                       pg_reducer=pg_reducer_for(trainer.config, batch, loss_batch))


def sft_loss_type(trainer: Any, batch: Any, loss_batch: PolicyLossBatch) -> LossResult:
    """``--loss-type sft_loss``."""
    return sft_loss(loss_batch, trainer.config)


def slime_batch(batch: Any, loss_batch: PolicyLossBatch) -> dict[str, Any]:
    """slime's micro-batch dict (``RolloutBatch`` keys) of a packed batch."""
    lengths = list(loss_batch.response_lengths)
    split = lambda flat: list(torch.split(flat, lengths)) if flat is not None else None  # noqa: E731
    bounds = batch.cu_seqlens.tolist()
    tokens = [batch.input_ids_T[start:end] for start, end in zip(bounds, bounds[1:])]
    out = {
        "unconcat_tokens": tokens,
        "tokens": tokens,
        "total_lengths": [len(t) for t in tokens],
        "response_lengths": lengths,
        "loss_masks": split(loss_batch.loss_mask),
        "advantages": split(loss_batch.advantages),
        "miles_log_probs": loss_batch.log_probs,
    }
    for key, flat in (("log_probs", loss_batch.old_log_probs), ("rollout_log_probs", loss_batch.rollout_log_probs),
                      ("ref_log_probs", loss_batch.ref_log_probs)):
        if flat is not None:
            out[key] = split(flat)
    return out


def policy_logits(trainer: Any, batch: Any) -> torch.Tensor:
    """``[1, T, V]`` logits of the packed batch under the training model."""
    from miles_host.models import PackedAttention
    from miles_host.models.context import ForwardContext

    model = trainer.model
    if not hasattr(model, "compute_logits"):
        raise ValueError(f"--loss-type custom_loss hands the policy's logits to the loss function, which --train-backend "
                         f"{trainer.config.train_backend} does not give (its output layer is split); use --train-backend "
                         "native, or --loss-type sft_loss / policy_loss")
    ctx = ForwardContext(attention=PackedAttention(batch.cu_seqlens), routing=batch.routing)
    with trainer._autocast():
        hidden_TH = model.forward_hidden(batch.input_ids_T, batch.positions_T, ctx)
        return model.compute_logits(hidden_TH).unsqueeze(0)


def custom_loss_type(trainer: Any, batch: Any, loss_batch: PolicyLossBatch) -> LossResult:
    """``--loss-type custom_loss``: slime's custom loss contract (module docstring)."""
    config = trainer.config
    function = _function(config.custom_loss_function_path, "--custom-loss-function-path")
    mask, lengths = loss_batch.loss_mask, loss_batch.response_lengths
    reducer = sum_of_sample_mean(config, mask, lengths)
    result = function(config, slime_batch(batch, loss_batch), policy_logits(trainer, batch), reducer)
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)):
        raise ValueError(f"--custom-loss-function-path {config.custom_loss_function_path}: must return "
                         "(loss tensor, metrics dict), as slime's loss functions do")
    loss, metrics = result
    count = micro_batch_count(config, mask.to(loss.dtype), lengths)
    metrics = {key: (value.detach() if isinstance(value, torch.Tensor) else value) / count
               for key, value in dict(metrics or {}).items()}
    return loss / count, metrics


#: ``--loss-type`` -> the micro-batch loss
LOSS_TYPES: dict[str, Callable[[Any, Any, PolicyLossBatch], LossResult]] = {
    "policy_loss": policy_loss_type,
    "sft_loss": sft_loss_type,
    "custom_loss": custom_loss_type,
}


def micro_batch_loss(trainer: Any, batch: Any, loss_batch: PolicyLossBatch) -> LossResult:
    """The run's ``--loss-type`` on one micro-batch."""
    return LOSS_TYPES[trainer.config.loss_type](trainer, batch, loss_batch)
