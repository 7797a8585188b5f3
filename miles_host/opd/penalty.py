"""The OPD penalty on the advantages and its metrics (upstream miles'
``apply_opd_kl_to_advantages``, ``miles/backends/training_utils/loss_hub/opd.py``).

Per response token ``t`` of a sample, with the student's log-prob ``s_t`` of the sampled
token (the old policy's: the trainer's recomputed log-probs, or the rollout's with
``--use-rollout-logprobs``) and the teacher's ``q_t``:

    reverse_kl_t = s_t - q_t                  (a one-sample estimate of KL(student || teacher))
    advantage_t  = advantage_t - opd_kl_coef * reverse_kl_t

applied after the estimator and before any whitening, so it composes with every
estimator; the policy loss and its aggregation are the run's own. At the old policy
(ratio 1) the gradient of the token's loss is ``opd_kl_coef * reverse_kl_t`` times the
gradient of its log-prob: the REINFORCE gradient of the reverse KL, pulling the student
toward the teacher on the tokens it samples.

Tensor legend: L = one sample's response tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from miles_host.sample import Sample


def teacher_log_probs_of(samples: Sequence[Sample]) -> list[torch.Tensor]:
    """Each sample's ``teacher_log_probs`` as float32 ``[L]``; ValueError naming the sample
    when one is missing or has the wrong length."""
    out = []
    for sample in samples:
        values = sample.teacher_log_probs
        if values is None:
            raise ValueError(
                f"--use-opd: sample {sample.index} (group {sample.group_index}) has no teacher_log_probs; the teacher "
                "scores every sample after generation (loaded samples without them are scored too), so this "
                "sample bypassed it: check --opd-type and the rollout function")
        if len(values) != sample.response_length:
            raise ValueError(
                f"--use-opd: sample {sample.index} has {len(values)} teacher_log_probs for {sample.response_length} "
                "response tokens")
        out.append(torch.tensor(values, dtype=torch.float32))
    return out


def student_log_probs_of(samples: Sequence[Sample], old_log_probs: Sequence[torch.Tensor] | None,
                         config: Any) -> list[torch.Tensor]:
    """The student's log-probs the penalty uses: the rollout's with ``--use-rollout-logprobs``
    (as upstream), else the old policy's recomputed ones (``[L]`` each, detached, on CPU)."""
    if config.use_rollout_logprobs:
        missing = [s.index for s in samples if s.rollout_log_probs is None]
        if missing:
            raise ValueError(f"--use-opd with --use-rollout-logprobs: samples {missing[:5]} have no rollout_log_probs")
        return [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples]
    if old_log_probs is None:
        raise ValueError("--use-opd needs the old policy's log-probs before the advantages; the trainer computes "
                         "them in its old-logprob pass")
    return [lp.detach().float().cpu() for lp in old_log_probs]


def reverse_kl(student_L: torch.Tensor, teacher_L: torch.Tensor) -> torch.Tensor:
    """``student - teacher`` per sampled token (shapes must agree)."""
    if student_L.shape != teacher_L.shape:
        raise ValueError(f"OPD shape mismatch: student log-probs {tuple(student_L.shape)}, teacher log-probs "
                         f"{tuple(teacher_L.shape)}")
    return student_L - teacher_L


def opd_penalties(samples: Sequence[Sample], old_log_probs: Sequence[torch.Tensor] | None,
                  config: Any) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Per sample ``[L]``: ``opd_kl_coef * reverse_kl`` (what the advantages lose), and the
    step's OPD metrics over the loss-masked tokens (:func:`opd_metrics`)."""
    student = student_log_probs_of(samples, old_log_probs, config)
    teacher = teacher_log_probs_of(samples)
    kls = [reverse_kl(s, t) for s, t in zip(student, teacher)]
    masks = [torch.tensor(s.loss_mask, dtype=torch.float32) if s.loss_mask is not None
             else torch.ones(s.response_length) for s in samples]
    return [config.opd_kl_coef * kl for kl in kls], opd_metrics(student, teacher, masks)


def opd_metrics(student: Sequence[torch.Tensor], teacher: Sequence[torch.Tensor],
                masks: Sequence[torch.Tensor]) -> dict[str, float]:
    """Token means over the loss-masked tokens of the step (float64): ``opd/kl`` (the mean
    reverse KL, student minus teacher log-prob), ``opd/student_log_prob``,
    ``opd/teacher_log_prob`` and ``opd/abs_log_prob_gap`` (mean ``|student - teacher|``)."""
    s = torch.cat(list(student)).double()
    t = torch.cat(list(teacher)).double()
    m = torch.cat(list(masks)).double()
    count = m.sum().clamp_min(1.0)
    mean = lambda x: float((x * m).sum() / count)  # noqa: E731
    return {
        "opd/kl": mean(s - t),
        "opd/student_log_prob": mean(s),
        "opd/teacher_log_prob": mean(t),
        "opd/abs_log_prob_gap": mean((s - t).abs()),
    }
