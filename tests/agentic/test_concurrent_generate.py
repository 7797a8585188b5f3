"""Custom generate functions run their trajectories concurrently, bounded by
--sglang-server-concurrency, fail one at a time, continue under --partial-rollout and
generate the eval samples too."""

from __future__ import annotations

import json
import time

import pytest

from miles_host.evaluation import evaluate
from miles_host.sample import Status
from tests.agentic import trajectories
from tests.agentic.scripted import make_manager

PATH = "tests.agentic.trajectories."
#: a reward that differs within every group (dynamic sampling keeps them all)
BY_INDEX = lambda sample, config: float(sample.index)  # noqa: E731


@pytest.fixture(autouse=True)
def fresh_gauge():
    trajectories.GAUGE = trajectories.Gauge()
    yield


@pytest.mark.parametrize("name", ["two_turns_async", "two_turns_sync"])
def test_slow_trajectories_take_about_one_trajectorys_time(name):
    manager, backend = make_manager(PATH + name, rollout_batch_size=4)  # 8 trajectories with a 0.5 s tool call
    start = time.perf_counter()
    groups, stats = manager.generate(0)
    elapsed = time.perf_counter() - start
    assert elapsed < 3 * trajectories.TOOL_S, f"8 trajectories took {elapsed:.2f} s: not concurrent"
    assert trajectories.GAUGE.peak == 8
    assert len(backend.threads) == 1  # every backend call on the driver's engine thread
    samples = [s for g in groups for s in g]
    assert len(samples) == 8 and stats.failed_samples == 0
    for sample in samples:
        assert sample.status is Status.TRUNCATED and sample.metadata["turns"] == 2  # ended at max_new_tokens
        assert sample.tokens[sample.prompt_length:] == [2, 3] + trajectories.TOOL_TOKENS + [2, 3]
        assert sample.loss_mask == [1, 1, 0, 0, 0, 1, 1]
        assert sample.rollout_log_probs == [-0.5, -0.5, 0.0, 0.0, 0.0, -0.5, -0.5]
    assert stats.generated_tokens == 8 * 4
    assert len({rid for rid, _, _ in backend.submitted}) == 16  # request ids are unique


@pytest.mark.parametrize("name", ["two_turns_async", "two_turns_sync"])
def test_concurrency_is_bounded(name):
    manager, _ = make_manager(PATH + name, rollout_batch_size=4, sglang_server_concurrency=3)
    start = time.perf_counter()
    manager.generate(0)
    assert trajectories.GAUGE.peak == 3 and trajectories.GAUGE.calls == 8
    assert time.perf_counter() - start >= 3 * trajectories.TOOL_S  # 8 trajectories, 3 at a time: 3 rounds


def test_a_failing_trajectory_fails_alone():
    manager, _ = make_manager(PATH + "fails_on_odd_groups", rollout_batch_size=4, max_failed_sample_fraction=1.0)
    groups, stats = manager.generate(0)
    assert stats.failed_samples == 4 and stats.finished_samples == 8
    assert "tool crashed on group" in stats.first_failure  # whichever failed first
    for group in groups:
        for sample in group:
            if sample.group_index % 2:
                assert sample.status is Status.FAILED
                assert sample.metadata["failure"].startswith("custom generate: RuntimeError: tool crashed")
            else:
                assert sample.status is Status.TRUNCATED and sample.response_length == 2


def test_too_many_failing_trajectories_stop_the_rollout():
    manager, _ = make_manager(PATH + "fails_on_odd_groups", rollout_batch_size=4, max_failed_sample_fraction=0.25)
    with pytest.raises(Exception, match="more than --max-failed-sample-fraction 0.25.*tool crashed on group"):
        manager.generate(0)


def test_blocking_generate_inside_the_event_loop_names_the_async_call():
    manager, _ = make_manager(PATH + "blocking_generate_in_async", max_failed_sample_fraction=1.0)
    groups, stats = manager.generate(0)
    assert stats.failed_samples == 4
    assert "session.async_generate" in groups[0][0].metadata["failure"]


def test_partial_rollout_continues_aborted_trajectories_next_rollout():
    manager, backend = make_manager(PATH + "long_on_later_groups", BY_INDEX, step_s=0.005, partial_rollout=True,
                                    over_sampling_batch_size=4)
    groups0, stats0 = manager.generate(0)
    assert [g[0].group_index for g in groups0] == [0, 1]
    assert stats0.buffered_samples == 4 and stats0.dropped_samples == 0
    buffered = {s.group_index: s for g in manager.buffer for s in g}
    assert set(buffered) == {2, 3}
    assert all(s.status is Status.ABORTED and 0 < s.response_length < 40 for s in buffered.values())
    groups1, stats1 = manager.generate(1)
    assert [g[0].group_index for g in groups1] == [2, 3]  # continued first, not re-sampled
    for sample in (s for g in groups1 for s in g):
        assert sample.status is Status.TRUNCATED and sample.response_length == 40  # nothing generated twice
        assert sample.metadata["calls"] == 2
        assert len(sample.loss_mask) == len(sample.rollout_log_probs) == 40
    seen = [s.group_index for g in groups0 + groups1 for s in g]
    assert len(seen) == len(set(seen)) * 2  # every group trained exactly once


def test_without_partial_rollout_aborted_trajectories_are_dropped_and_counted():
    manager, _ = make_manager(PATH + "long_on_later_groups", BY_INDEX, step_s=0.005, over_sampling_batch_size=4)
    groups, stats = manager.generate(0)
    assert len(groups) == 2 and stats.dropped_samples == 4 and manager.buffer == []


def test_eval_uses_the_custom_generate_function(tmp_path):
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"input": f"q{i}", "label": str(i)}) + "\n" for i in range(3)))
    manager, _ = make_manager(PATH + "two_turns_async", n_samples_per_eval_prompt=2)
    start = time.perf_counter()
    score = evaluate(manager.config, manager, str(data), 0)
    assert trajectories.GAUGE.calls == 6 and trajectories.GAUGE.peak == 6  # all at once
    assert time.perf_counter() - start < 3 * trajectories.TOOL_S
    assert score == 7.0  # the reward: response length (2 + 3 tool tokens + 2)


def test_a_stopped_rollout_releases_worker_threads_blocked_in_generate():
    import threading

    before = threading.active_count()
    manager, backend = make_manager(PATH + "fails_fast_or_generates_long", step_s=0.002, rollout_batch_size=2,
                                    over_sampling_batch_size=8, max_failed_sample_fraction=0.25)
    start = time.perf_counter()
    with pytest.raises(Exception, match="tool crashed on group"):
        manager.generate(0)
    assert time.perf_counter() - start < 10  # not waiting for 10,000-token requests
    assert backend.running == {}  # the engine's requests were aborted
    deadline = time.perf_counter() + 5
    while threading.active_count() > before and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before  # no worker left blocked
