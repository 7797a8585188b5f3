"""``--old-logprob-pass auto``: with one optimizer step per rollout the old policy's log-probs
are the training forward's own, so the separate pass is skipped and nothing else changes."""

from __future__ import annotations

import pytest

from miles_host.cli.main import main
from miles_host.trainer import NativeTrainer
from tests.loop.conftest import base_args, read_metrics


@pytest.fixture
def old_passes(monkeypatch):
    phases: list[str] = []
    original = NativeTrainer._log_probs_without_grad

    def counting(self, model, samples, phase):
        phases.append(phase)
        return original(self, model, samples, phase)

    monkeypatch.setattr(NativeTrainer, "_log_probs_without_grad", counting)
    return phases


def test_one_optimizer_step_skips_the_pass_with_the_same_metrics(tiny_task, tmp_path, old_passes):
    model, data = tiny_task
    common = ("--num-rollout", "2", "--micro-batch-size", "3", "--use-tis")
    assert main(base_args(model, data, tmp_path / "always", *common, "--old-logprob-pass", "always")) == 0
    assert old_passes.count("old_logprob") > 0
    old_passes.clear()
    assert main(base_args(model, data, tmp_path / "auto", *common)) == 0
    assert old_passes.count("old_logprob") == 0
    for want, have in zip(read_metrics(tmp_path / "always"), read_metrics(tmp_path / "auto")):
        for key in want:
            if not key.startswith("perf/"):
                assert have[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key


def test_several_optimizer_steps_or_a_kl_reward_keep_the_pass(tiny_task, tmp_path, old_passes):
    model, data = tiny_task
    assert main(base_args(model, data, tmp_path / "steps", "--num-rollout", "1", "--global-batch-size", "8")) == 0
    assert old_passes.count("old_logprob") == 1
    old_passes.clear()
    assert main(base_args(model, data, tmp_path / "kl", "--num-rollout", "1", "--kl-coef", "0.01")) == 0
    assert old_passes.count("old_logprob") == 1
