"""A worker's heartbeat tells a stopped worker (SIGSTOP: no beat) from a busy one (beats,
does not answer) and from a dead one (its exit code)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from miles_host.distributed.comm import WorkerHandle
from miles_host.distributed.errors import WorkerFailed
from miles_host.distributed.heartbeat import Heartbeat
from tests.distributed.heartbeat_worker import beat_and_wait


def test_a_busy_worker_times_out_a_stopped_one_is_hung_a_killed_one_dead():
    ctx = mp.get_context("spawn")
    heartbeat = Heartbeat(ctx, interval_s=0.1, timeout_s=0.5)
    parent, child = ctx.Pipe()
    process = ctx.Process(target=beat_and_wait, args=(heartbeat, child), daemon=True)
    process.start()
    handle = WorkerHandle("worker-0", process, parent, timeout_s=60, heartbeat=heartbeat)
    try:
        deadline = time.monotonic() + 60
        while heartbeat.value.value == 0.0 and time.monotonic() < deadline:  # started beating
            time.sleep(0.05)
        with pytest.raises(WorkerFailed) as busy:  # beats but does not answer: only the reply limit ends the wait
            handle.recv("a reply", timeout_s=1.0)
        assert busy.value.kind == "hung" and "did not answer a reply within 1 s" in str(busy.value)

        os.kill(process.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(WorkerFailed) as stopped:
            handle.recv("a reply")
        assert time.monotonic() - started < 0.1 + 0.5 + 2.0  # interval + timeout, not the 60 s reply limit
        assert stopped.value.kind == "hung" and "sent no heartbeat" in str(stopped.value), stopped.value

        os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(WorkerFailed) as killed:
            handle.recv("a reply")
        assert killed.value.kind == "died" and "killed by signal 9" in str(killed.value)
    finally:
        handle.stop(0)


def test_no_verdict_before_the_first_beat_or_within_the_first_wait():
    heartbeat = Heartbeat(mp.get_context("spawn"), interval_s=1.0, timeout_s=1.0, first_wait_s=100.0)
    assert heartbeat.silent_for() is None  # no beat yet: still starting
    heartbeat.value.value = time.monotonic() - 50
    assert heartbeat.silent_for() is None  # silent 50 s, but within the first 100 s
    heartbeat.created -= 100
    assert heartbeat.silent_for() == pytest.approx(50, abs=1)
    heartbeat.value.value = time.monotonic() - 1.5
    assert heartbeat.silent_for() is None  # within interval + timeout
