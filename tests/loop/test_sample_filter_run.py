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


@pytest.fixture
def post_process_module(tmp_path, monkeypatch):
    (tmp_path / "my_post.py").write_text(textwrap.dedent("""
        def centre(args, samples):
            raw = [float(s.reward) for s in samples]
            mean = sum(raw) / len(raw)
            return raw, [2.0 * (r - mean) for r in raw]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_post", None)


def test_reward_post_process_replaces_the_rewards():
    from types import SimpleNamespace

    from miles_host.reward_post_process import apply_reward_post_process, check_post_process

    config = SimpleNamespace(custom_reward_post_process_path="x.y", disable_rewards_normalization=False)
    check_post_process(config)
    assert config.disable_rewards_normalization  # slime skips its normalisation
    groups = [[Sample(reward=r) for r in (0.0, 1.0, 1.0)]]
    metrics = apply_reward_post_process(config, groups, lambda args, s: ([x.reward for x in s], [x.reward - 0.5 for x in s]))
    assert [s.reward for s in groups[0]] == [-0.5, 0.5, 0.5]
    assert [s.metadata["raw_reward"] for s in groups[0]] == [0.0, 1.0, 1.0]
    assert metrics["rollout/raw_reward_mean"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="1 raw rewards and 1 rewards for 3"):
        apply_reward_post_process(config, groups, lambda args, s: ([0.0], [0.0]))


def test_a_run_with_a_slime_reward_post_process(tiny_task, tmp_path, post_process_module):
    model, data = tiny_task
    out = tmp_path / "out"
    assert main(base_args(model, data, out, "--num-rollout", "2",
                          "--custom-reward-post-process-path", "my_post.centre")) == 0
    steps = [m for m in read_metrics(out) if "rollout/raw_reward_mean" in m]
    assert len(steps) == 2
    for metrics in steps:  # 2 * (r - mean) averages to 0; the raw mean is the accuracy
        assert metrics["rollout/post_processed_reward_mean"] == pytest.approx(0.0, abs=1e-9)
        assert 0.0 <= metrics["rollout/raw_reward_mean"] <= 1.0
