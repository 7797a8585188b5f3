"""Flags of on-policy distillation (OPD), upstream miles' spellings and defaults.

The student rolls out; a teacher scores the student's sampled tokens (its log-probs of
them, ``Sample.teacher_log_probs``); the per-token reverse KL on those tokens,
``student log-prob - teacher log-prob``, times ``--opd-kl-coef`` is subtracted from the
estimator's advantages (:mod:`miles_host.opd`). Where the teacher runs is
``--opd-type``:

- ``embedded``: a second, frozen model in this process, loaded from
  ``--opd-teacher-load``; ``megatron`` (upstream's name of its in-process teacher) is
  the same teacher here.
- ``sglang``: a served teacher (``miles serve`` or SGLang) at ``--opd-teacher-urls``,
  whose prefill returns the input tokens' log-probs.

:func:`miles_host.opd.checks.check_opd` checks the values and combinations.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles_host.config_fields import optional_int, flag

#: ``--opd-type`` values: where the teacher runs (:data:`miles_host.opd.teachers.TEACHER_TYPES`)
OPD_TYPES = ("embedded", "megatron", "sglang")


@dataclass
class OpdArgs:
    use_opd: bool = flag(False, "on-policy distillation: the teacher's log-probs of the student's sampled tokens turn into a per-token reverse-KL penalty on the advantages (with the RL reward, or alone: without a reward flag every sample's reward is 0); needs --opd-type", group="opd")
    opd_type: str | None = flag(None, "where the OPD teacher runs: embedded (a frozen model in this process from --opd-teacher-load; megatron is upstream's name for it and means the same here) or sglang (a served teacher at --opd-teacher-urls: miles serve or SGLang)", type=str, choices=list(OPD_TYPES), group="opd")
    opd_kl_coef: float = flag(1.0, "weight of the OPD reverse KL (student log-prob - teacher log-prob of each sampled token) subtracted from the advantages", type=float, group="opd")
    opd_teacher_load: str | None = flag(None, "the OPD teacher for --opd-type embedded/megatron: an HF-format model directory (the student's tokenizer), or a miles --save directory (the student's architecture, its latest checkpoint or --opd-teacher-ckpt-step)", type=str, group="opd")
    opd_teacher_ckpt_step: int | None = flag(None, "the checkpoint iteration of a --save directory given as --opd-teacher-load (default: its latest)", type=optional_int, group="opd")
    opd_teacher_urls: list[str] | None = flag(None, "the served OPD teacher for --opd-type sglang: a URL (http://host:port, /generate optional), or NAME=URL pairs routed by sample.metadata[--opd-teacher-key] with the name default as the fallback", type=str, nargs="+", group="opd")
    opd_teacher_key: str = flag("opd_teacher", "sample metadata key holding the teacher name of --opd-teacher-urls NAME=URL routing", type=str, group="opd")
    opd_log_prob_top_k: int = flag(0, "top-k tokens of upstream's Rethinking-OPD reward; only 0 (the sampled-token reverse KL) is implemented", type=int, group="opd")
