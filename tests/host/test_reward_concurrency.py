"""The samples of a group are scored at the same time, at most MAX_CONCURRENT_REWARDS at once."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from miles_host.reward import RewardScorer, RewardTimeout, call_each
from miles_host.sample import Sample, Status

DELAY_S = 0.4


def _scorer(function, timeout_s=30.0):
    scorer = RewardScorer(SimpleNamespace(group_rm=False, rm_timeout=timeout_s, custom_rm_path=None, rm_url=None,
                                          rm_type="x", reward_key=None),
                          SimpleNamespace(get=lambda name: SimpleNamespace(fn=function, group=False)))
    return scorer


def _group(n):
    return [Sample(prompt="p", tokens=[1, 2], response=str(i), label=str(i)) for i in range(n)]


async def slow_async_reward(sample, config):
    await asyncio.sleep(DELAY_S)
    return float(sample.response)


def slow_sync_reward(sample, config):
    time.sleep(DELAY_S)
    return float(sample.response)


@pytest.mark.parametrize("reward", [slow_async_reward, slow_sync_reward])
def test_a_group_of_slow_rewards_takes_about_one_rewards_time(reward):
    samples = _group(8)
    start = time.perf_counter()
    _scorer(reward).score_group(samples)
    elapsed = time.perf_counter() - start
    assert [s.reward for s in samples] == [float(i) for i in range(8)]
    assert elapsed < 3 * DELAY_S, f"8 rewards of {DELAY_S} s took {elapsed:.2f} s: not scored concurrently"


def test_concurrency_is_bounded():
    running, peak, lock = [0], [0], threading.Lock()

    def reward(sample, config):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return 1.0

    results = call_each(reward, [(i, None) for i in range(10)], timeout_s=5.0, limit=3)
    assert results == [(1.0, None)] * 10 and peak[0] == 3


def test_one_slow_or_failing_sample_fails_alone():
    async def reward(sample, config):
        if sample.response == "1":
            await asyncio.sleep(5)
        if sample.response == "2":
            raise RuntimeError("no grader for this one")
        return 1.0

    samples = _group(4)
    start = time.perf_counter()
    _scorer(reward, timeout_s=0.3).score_group(samples)
    assert time.perf_counter() - start < 2.0
    assert [s.status is Status.FAILED for s in samples] == [False, True, True, False]
    assert "RewardTimeout" in samples[1].metadata["failure"] and "no grader" in samples[2].metadata["failure"]
    assert issubclass(RewardTimeout, TimeoutError)
