"""--rollout-sample-filter-path in a tiny run: slime's filter(args, groups) marks samples with
remove_sample; their loss masks become zeros and the run reports how many."""

from __future__ import annotations

import sys
import textwrap

import pytest

from miles_host.cli.main import main
from miles_host.sample import Sample
from miles_host.sample_filters import apply_rollout_sample_filter
from tests.loop.conftest import base_args, read_metrics


class Config:
    rollout_sample_filter_path = None


def test_marked_samples_lose_their_loss_mask_only():
    groups = [[Sample(tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 1], reward=r) for r in (0.0, 1.0)]]

    def drop_wrong(args, groups):
        for group in groups:
            for sample in group:
                sample.remove_sample = sample.reward == 0

    assert apply_rollout_sample_filter(Config(), groups, drop_wrong) == 1
    assert [s.loss_mask for s in groups[0]] == [[0, 0], [1, 1]]
    assert [s.reward for s in groups[0]] == [0.0, 1.0]  # rewards untouched
    with pytest.raises(TypeError, match="must return None"):
        apply_rollout_sample_filter(Config(), groups, lambda args, groups: groups)


@pytest.fixture
def filter_module(tmp_path, monkeypatch):
    (tmp_path / "my_filters.py").write_text(textwrap.dedent("""
        def drop_wrong(args, groups):
            assert args.rollout_sample_filter_path == "my_filters.drop_wrong"
            for group in groups:
                for sample in group:
                    sample.remove_sample = sample.reward == 0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_filters", None)


def test_a_run_with_a_slime_sample_filter(tiny_task, tmp_path, filter_module):
    model, data = tiny_task
    out = tmp_path / "out"
    assert main(base_args(model, data, out, "--num-rollout", "2",
                          "--rollout-sample-filter-path", "my_filters.drop_wrong")) == 0
    steps = [m for m in read_metrics(out) if "rollout/removed_samples" in m]
    assert len(steps) == 2
    for metrics in steps:  # 4 prompts x 4 samples, rewards 0 or 1: the wrong ones are removed
        assert metrics["rollout/removed_samples"] == round(16 * (1 - metrics["rollout/reward_mean"]))
