"""OPD runs on the tiny addition task: the student (a random tiny model) moves toward a
different, peaked tiny teacher with ``--use-opd`` alone (no reward), and does not without
the penalty; teacher log-probs travel with the samples into dumps and debug rollouts;
a ``miles serve`` teacher drives the same run."""

from __future__ import annotations

import json

import pytest
import torch

from miles_host.cli.main import main
from tests.loop.conftest import read_metrics


def opd_args(student, teacher, data, out, *extra):
    """A fast CPU OPD run without a reward flag (every reward 0: the teacher is the only signal)."""
    return ["run", "--hf-checkpoint", str(student), "--prompt-data", str(data), "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8", "--lr", "1e-2", "--output-dir", str(out),
            "--no-progress", "--rollout-shuffle", "--seed", "2", "--rollout-seed", "2",
            "--use-opd", "--opd-type", "embedded", "--opd-teacher-load", str(teacher), *extra]


def first_and_last(values: list[float], k: int = 4) -> tuple[float, float]:
    return sum(values[:k]) / k, sum(values[-k:]) / k


def test_opd_alone_pulls_the_student_toward_the_teacher(opd_task, tmp_path):
    student, teacher, data = opd_task
    assert main(opd_args(student, teacher, data, tmp_path / "opd", "--num-rollout", "16")) == 0
    metrics = read_metrics(tmp_path / "opd")
    assert all(m["rollout/reward_mean"] == 0.0 for m in metrics)
    start, end = first_and_last([m["opd/kl"] for m in metrics])
    assert start > 1.0 and end < 0.5 * start, (start, end)
    gap_start, gap_end = first_and_last([m["opd/abs_log_prob_gap"] for m in metrics])
    assert gap_end < 0.7 * gap_start, (gap_start, gap_end)
    # the control: the same run without the penalty leaves the student where it was
    assert main(opd_args(student, teacher, data, tmp_path / "none", "--num-rollout", "8", "--opd-kl-coef", "0")) == 0
    control = read_metrics(tmp_path / "none")
    assert all(m["train/grad_norm"] == 0.0 for m in control)
    start, end = first_and_last([m["opd/kl"] for m in control])
    assert end > 0.8 * start, (start, end)


def test_teacher_log_probs_travel_with_dumped_and_debug_samples(opd_task, tmp_path):
    """--debug-rollout-only saves scored samples; a --load-debug-rollout-data run trains on
    them without scoring them again; --dump-rollouts holds them too."""
    from miles_host.opd.embedded import EmbeddedTeacher
    from miles_host.config import MilesConfig
    from miles_host.sample import Sample

    student, teacher, data = opd_task
    saved = tmp_path / "debug_{rollout_id}.pt"
    assert main(opd_args(student, teacher, data, tmp_path / "gen", "--num-rollout", "1", "--debug-rollout-only",
                         "--save-debug-rollout-data", str(saved), "--dump-rollouts")) == 0
    payload = torch.load(str(saved).format(rollout_id=0), weights_only=False)
    samples = [Sample.from_dict(s) if isinstance(s, dict) else s for s in payload["samples"]]
    assert samples and all(s.teacher_log_probs is not None for s in samples)
    config = MilesConfig(hf_checkpoint=str(student), use_opd=True, opd_type="embedded", opd_teacher_load=str(teacher),
                         device="cpu")
    expected = EmbeddedTeacher(config).log_probs(samples)
    for sample, want in zip(samples, expected):
        assert sample.teacher_log_probs == pytest.approx(want, abs=1e-5)
    dump = tmp_path / "gen" / "rollouts" / "rollout_00000.jsonl"
    dumped = [json.loads(line) for line in dump.read_text().splitlines()]
    assert [d["teacher_log_probs"] for d in dumped] == [s.teacher_log_probs for s in samples]

    assert main(opd_args(student, teacher, data, tmp_path / "train", "--num-rollout", "1",
                         "--load-debug-rollout-data", str(saved))) == 0
    (step,) = read_metrics(tmp_path / "train")
    assert step["opd/teacher_scored_samples"] == 0.0
    kept = [v for s in samples for v, m in zip(
        [a - b for a, b in zip(s.rollout_log_probs, s.teacher_log_probs)], s.loss_mask) if m]
    # the trainer's old log-probs are the rollout's up to float rounding (the same model code)
    assert step["opd/kl"] == pytest.approx(sum(kept) / len(kept), abs=1e-4)


def test_served_teacher_run(opd_task, tmp_path):
    """--opd-type sglang with ``miles serve`` of the teacher: the run's opd/kl is the embedded
    teacher's run's (same samples, same teacher log-probs up to float rounding)."""
    pytest.importorskip("miles_sglang")
    from tests.plugins.sglang.conftest import serve

    student, teacher, data = opd_task
    handle = serve(teacher)
    try:
        served = opd_args(student, teacher, data, tmp_path / "served", "--num-rollout", "2")
        at = served.index("--opd-type")
        served[at:at + 4] = ["--opd-type", "sglang", "--opd-teacher-urls", handle.url]
        assert main(served) == 0
    finally:
        handle.shutdown()
    assert main(opd_args(student, teacher, data, tmp_path / "embedded", "--num-rollout", "2")) == 0
    for have, want in zip(read_metrics(tmp_path / "served"), read_metrics(tmp_path / "embedded")):
        assert have["opd/kl"] == pytest.approx(want["opd/kl"], abs=1e-3)
        assert have["opd/teacher_log_prob"] == pytest.approx(want["opd/teacher_log_prob"], abs=1e-3)


def test_fully_async_run_scores_every_trained_batch(opd_task, tmp_path):
    student, teacher, data = opd_task
    assert main(opd_args(student, teacher, data, tmp_path / "async", "--num-rollout", "2", "--fully-async")) == 0
    for step in read_metrics(tmp_path / "async"):
        assert step["opd/teacher_scored_samples"] == 16.0 and step["opd/kl"] > 0.5
