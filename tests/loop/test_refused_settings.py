"""Settings that would disable or reverse learning are refused before anything starts,
by ``miles run`` and ``--dry-run`` alike, with a message naming the flag."""

from __future__ import annotations

import pytest

from miles_host.cli.main import main
from tests.loop.conftest import base_args

REFUSED = {
    "negative clip": (["--clip-grad", "-1"], "--clip-grad must be positive"),
    "zero clip": (["--clip-grad", "0"], "--clip-grad must be positive"),
    "negative eps clip": (["--eps-clip", "-0.2"], "--eps-clip must be >= 0"),
    "negative save interval": (["--save-interval", "-1", "--save", "{tmp}/ckpt"], "--save-interval must be a positive"),
    "save interval without save": (["--save-interval", "2"], "--save-interval needs --save"),
    "remainder step": (["--global-batch-size", "5"], "--global-batch-size 5 does not divide the 16 samples"),
    "kl coef without kl loss": (["--kl-loss-coef", "0.1"], "--kl-loss-coef 0.1 has no effect without --use-kl-loss"),
    "no nan tolerance": (["--max-consecutive-nan-steps", "0"], "--max-consecutive-nan-steps must be >= 1"),
    "zero worker timeout": (["--worker-timeout", "0"], "--worker-timeout must be a positive"),
    "negative worker timeout": (["--worker-timeout", "-5"], "--worker-timeout must be a positive"),
    "negative lr": (["--lr", "-1e-4"], "--lr must be >= 0, got -0.0001"),
    "failed fraction above 1": (["--max-failed-sample-fraction", "2"], "--max-failed-sample-fraction must be between"),
    "grpo with one sample": (["--n-samples-per-prompt", "1"], "--n-samples-per-prompt 1 makes every advantage 0"),
    "rloo with one sample": (["--n-samples-per-prompt", "1", "--advantage-estimator", "rloo",
                              "--disable-rewards-normalization"], "--n-samples-per-prompt 1 makes every advantage 0"),
    "more samples than engine sequences": (["--n-samples-per-prompt", "300", "--global-batch-size", "1200"],
                                           "--n-samples-per-prompt 300 exceeds"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_setting_that_disables_or_reverses_learning_is_refused(tiny_task, tmp_path, capsys, case):
    model, data = tiny_task
    flags, message = REFUSED[case]
    flags = [f.format(tmp=tmp_path) for f in flags]
    for extra in ([], ["--dry-run"]):
        assert main(base_args(model, data, tmp_path / "out", *flags, *extra)) == 2, case
        err = capsys.readouterr().err
        assert message in err, err
    assert not (tmp_path / "out").exists()  # nothing started


@pytest.mark.parametrize("flags", [
    ["--n-samples-per-prompt", "1", "--disable-rewards-normalization"],  # GRPO on the raw reward
    ["--n-samples-per-prompt", "1", "--advantage-estimator", "reinforce_plus_plus"],  # no group baseline
    ["--global-batch-size", "8", "--clip-grad", "1e9", "--use-kl-loss", "--kl-loss-coef", "0.01"],
])
def test_settings_that_still_learn_are_accepted(tiny_task, tmp_path, capsys, flags):
    model, data = tiny_task
    assert main(base_args(model, data, tmp_path / "out", *flags, "--dry-run")) == 0, capsys.readouterr().err


def test_one_sample_per_prompt_by_default_is_a_warning(tiny_task, capsys):
    """Not given, --n-samples-per-prompt is slime's default 1: told, not refused."""
    model, data = tiny_task
    assert main(["run", "--hf-checkpoint", str(model), "--prompt-data", str(data), "--label-key", "label",
                 "--rm-type", "exact", "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "miles: warning: --advantage-estimator grpo compares each sample" in err and "(1 is the default)" in err
