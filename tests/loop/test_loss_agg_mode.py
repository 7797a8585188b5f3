"""``--loss-agg-mode``: a run's loss, gradient and metrics do not depend on how the step is
cut into micro-batches (the trainer's shares add the micro-batches up to the whole step)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from miles_host.cli.main import main
from tests.loop.conftest import base_args, read_metrics


@pytest.fixture
def varied_reward(tmp_path, monkeypatch):
    """A reward with variance inside a group (the random policy never adds correctly)."""
    (tmp_path / "agg_rewards.py").write_text(textwrap.dedent(
        """
        def odd_first_char(sample, config):
            return float(sample.response[:1] in ("1", "3", "5", "7", "9", "+"))
        """
    ))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("agg_rewards", None)
    return ["--custom-rm-path", "agg_rewards.odd_first_char"]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"])
def test_micro_batching_does_not_change_the_steps(tiny_task, tmp_path, varied_reward, mode):
    """Two optimizer steps of 8 samples, in one micro-batch each or in micro-batches of 3."""
    model, data = tiny_task
    rows = {}
    for micro in ("8", "3"):
        out = tmp_path / micro
        flags = ("--num-rollout", "1", "--global-batch-size", "8", "--loss-agg-mode", mode,
                 "--micro-batch-size", micro, "--lr", "2e-2", *varied_reward)
        assert main([arg for arg in base_args(model, data, out, *flags) if arg not in ("--rm-type", "exact")]) == 0
        rows[micro] = read_metrics(out)[0]
    whole, split = rows["8"], rows["3"]
    assert whole["train/grad_norm"] > 0 and whole["train/pg_loss"] != 0 and whole["train/pg_clipfrac"] > 0
    for key in ("train/loss", "train/grad_norm", "train/pg_loss", "train/pg_clipfrac", "train/ppo_kl"):
        assert split[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-7), key
    assert 0.0 < split["train/pg_clipfrac"] < 1.0
