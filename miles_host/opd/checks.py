"""The OPD flags' checks (a host check of :mod:`miles_host.validation`): values, the
teacher each ``--opd-type`` needs, a teacher whose vocabulary is not the student's, and
settings OPD cannot work with. ValueError / FileNotFoundError naming the flag."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from miles_host.checkpoint import LATEST, has_checkpoint
from miles_host.opd.served import parse_teacher_urls
from miles_host.opd.teachers import TEACHER_TYPES
from miles_host.tokenizer_loading import TOKENIZER_FILES

logger = logging.getLogger(__name__)

#: OPD flags that mean nothing without --use-opd (field -> its value when unset)
_OPD_ONLY = {"opd_type": None, "opd_teacher_load": None, "opd_teacher_urls": None, "opd_teacher_ckpt_step": None,
             "opd_log_prob_top_k": 0}


def check_opd(config: Any, registries: Any = None) -> None:
    """Every OPD check, in order: flags without ``--use-opd``, values, the teacher, combinations."""
    if not config.use_opd:
        for name, unset in _OPD_ONLY.items():
            if getattr(config, name) not in (unset, []):
                raise ValueError(f"--{name.replace('_', '-')} is set but --use-opd is not; add --use-opd (on-policy "
                                 "distillation) or drop the flag")
        return
    check_opd_values(config)
    if TEACHER_TYPES[config.opd_type].loads_checkpoint:
        check_checkpoint_teacher(config)
    else:
        check_served_teacher(config)
    check_opd_combinations(config)


def check_opd_values(config: Any) -> None:
    """``--opd-type`` given, ``--opd-kl-coef`` a finite number >= 0, top-k 0."""
    if config.opd_type is None:
        raise ValueError(f"--use-opd needs --opd-type: one of {', '.join(TEACHER_TYPES)} (embedded: a teacher model "
                         "in this process from --opd-teacher-load; sglang: a served teacher at --opd-teacher-urls)")
    if config.opd_type not in TEACHER_TYPES:
        raise ValueError(f"--opd-type {config.opd_type!r}: choose one of {', '.join(TEACHER_TYPES)}")
    if not (math.isfinite(config.opd_kl_coef) and config.opd_kl_coef >= 0):
        raise ValueError(f"--opd-kl-coef must be a finite number >= 0, got {config.opd_kl_coef:g} (a negative "
                         "weight would push the student away from the teacher)")
    if config.opd_log_prob_top_k != 0:
        raise ValueError(f"--opd-log-prob-top-k {config.opd_log_prob_top_k}: only 0 (the sampled-token reverse KL) "
                         "is implemented; upstream's top-k Rethinking-OPD reward is not; drop the flag")


def check_checkpoint_teacher(config: Any) -> None:
    """``--opd-type embedded/megatron``: ``--opd-teacher-load`` is an HF model directory
    with the student's vocabulary, or a miles ``--save`` directory (with the asked step)."""
    flag = f"--opd-type {config.opd_type}"
    if config.opd_teacher_urls:
        raise ValueError(f"--opd-teacher-urls is for a served teacher (--opd-type sglang); {flag} loads "
                         "--opd-teacher-load in this process: drop one of the two")
    path = config.opd_teacher_load
    if path is None:
        raise ValueError(f"{flag} needs --opd-teacher-load: the teacher's HF model directory (or a miles --save "
                         "directory of a run of this model)")
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"--opd-teacher-load {path}: no such directory")
    if has_checkpoint(str(root)):
        step = config.opd_teacher_ckpt_step
        if step is not None and not (root / f"iter_{step:07d}").is_dir():
            raise FileNotFoundError(f"--opd-teacher-ckpt-step {step}: {root / f'iter_{step:07d}'} does not exist")
        return  # the student's architecture and vocabulary by construction
    if config.opd_teacher_ckpt_step is not None:
        raise ValueError(f"--opd-teacher-ckpt-step picks an iteration of a miles --save directory, but "
                         f"--opd-teacher-load {path} is an HF model directory (no {LATEST}); drop the step")
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"--opd-teacher-load {path}: neither an HF model directory (no config.json) nor a "
                                f"miles --save directory (no {LATEST}, no iter_* folders)")
    check_same_vocabulary(config.hf_checkpoint, path)


def _read_vocab_size(path: str) -> int | None:
    from miles_host.models.loading import read_hf_config

    hf = read_hf_config(path)
    size = hf.get("vocab_size", (hf.get("text_config") or {}).get("vocab_size"))
    return int(size) if size is not None else None


def check_same_vocabulary(student: str | None, teacher: str) -> None:
    """The teacher's token ids mean what the student's do: the same tokenizer vocabulary
    when the teacher has a tokenizer, else the same ``vocab_size``; and the teacher's
    output layer covers every id of the student's tokenizer."""
    if student is None or not (Path(student) / "config.json").is_file():
        return  # the required-inputs check reports the student
    student_size, teacher_size = _read_vocab_size(student), _read_vocab_size(teacher)
    if any((Path(teacher) / name).is_file() for name in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        student_vocab = AutoTokenizer.from_pretrained(student).get_vocab()
        teacher_vocab = AutoTokenizer.from_pretrained(teacher).get_vocab()
        if student_vocab != teacher_vocab:
            differing = sorted(set(student_vocab.items()) ^ set(teacher_vocab.items()))[:3]
            raise ValueError(
                f"--opd-teacher-load {teacher}: its tokenizer is not the student's (--hf-checkpoint {student}): "
                f"{len(teacher_vocab)} vs {len(student_vocab)} tokens, e.g. {differing} differ; OPD compares the "
                "two models' log-probs of the same token ids, so the teacher must share the student's tokenizer")
        if teacher_size is not None and teacher_size < len(student_vocab):
            raise ValueError(f"--opd-teacher-load {teacher}: vocab_size {teacher_size} is smaller than the "
                             f"tokenizer's {len(student_vocab)} tokens")
    elif student_size != teacher_size:
        raise ValueError(
            f"--opd-teacher-load {teacher}: vocab_size {teacher_size} differs from the student's {student_size} "
            f"(--hf-checkpoint {student}) and the teacher has no tokenizer to show the ids agree; OPD needs a "
            "teacher with the student's vocabulary")


def check_served_teacher(config: Any) -> None:
    """``--opd-type sglang``: ``--opd-teacher-urls`` given and well-formed, nothing to load."""
    if config.opd_teacher_load is not None or config.opd_teacher_ckpt_step is not None:
        raise ValueError("--opd-teacher-load / --opd-teacher-ckpt-step load an in-process teacher (--opd-type "
                         "embedded); --opd-type sglang scores with the server at --opd-teacher-urls: drop them")
    if not config.opd_teacher_urls:
        raise ValueError("--opd-type sglang needs --opd-teacher-urls: the teacher server (miles serve or SGLang, "
                         "e.g. http://host:30000), or NAME=URL pairs")
    parse_teacher_urls(config.opd_teacher_urls)
    if config.rollout_temperature not in (0, 1):
        logger.warning("--opd-type sglang: the server's input log-probs are of the raw logits (temperature 1), the "
                       "student's at --rollout-temperature %g; the embedded teacher scores at the rollout's",
                       config.rollout_temperature)


def check_opd_combinations(config: Any) -> None:
    """Settings under which the OPD penalty would be computed and never used."""
    if config.loss_type == "sft_loss" or config.disable_compute_advantages_and_returns:
        which = "--loss-type sft_loss" if config.loss_type == "sft_loss" else "--disable-compute-advantages-and-returns"
        raise ValueError(f"--use-opd with {which}: the OPD penalty acts through the advantages, which this run does "
                         "not use; drop one of the two")
    if config.over_sampling_batch_size and not config.dynamic_sampling_filter_path and not has_training_reward(config):
        raise ValueError("--use-opd without a reward gives every sample reward 0, and the built-in dynamic sampling "
                         "filter of --over-sampling-batch-size drops every group whose rewards all agree: no group "
                         "would ever be kept; drop --over-sampling-batch-size, give a reward, or give "
                         "--dynamic-sampling-filter-path")
    if config.eval_prompt_data and not has_training_reward(config) and not _eval_sets_have_rewards(config):
        raise ValueError("--use-opd without a reward trains on the teacher alone, but evaluation (--eval-prompt-data) "
                         "needs a reward to score its answers: give each --eval-config data set its rm_type or "
                         "custom_rm_path, or give --rm-type / --custom-rm-path / --rm-url (that reward then joins the "
                         "training signal too), or drop the evaluation")


def has_training_reward(config: Any) -> bool:
    """Whether a reward flag scores the training samples (without one, OPD's rewards are 0)."""
    return bool(config.rm_type or config.custom_rm_path or config.rm_url)


def _eval_sets_have_rewards(config: Any) -> bool:
    if not config.eval_config:
        return False
    from miles_host.eval_config import load_eval_config

    return all(spec.rm_type or spec.custom_rm_path for spec in load_eval_config(config))
