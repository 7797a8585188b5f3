"""A worker process's heartbeat, to tell a hung worker from a busy one.

The worker runs a daemon thread that writes ``time.monotonic()`` (one clock for every
process of the machine) into a shared double every ``interval_s`` seconds, whatever its
main thread is doing: a long generation step keeps beating, a process stopped with
SIGSTOP (or frozen holding the GIL) does not. The driver reads the value while it waits
for a reply (:meth:`WorkerHandle.recv <miles_host.distributed.comm.WorkerHandle.recv>`)
and calls the worker hung once its last beat is older than ``interval_s + timeout_s``.
A dead worker is found sooner, from its exit code.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class Heartbeat:
    """One worker's heartbeat: made by the driver, passed to the worker at spawn."""

    def __init__(self, ctx: Any, interval_s: float, timeout_s: float, first_wait_s: float = 0.0):
        self.value = ctx.Value("d", 0.0, lock=False)
        self.interval_s = float(interval_s)
        self.timeout_s = float(timeout_s)
        self.first_wait_s = float(first_wait_s)
        self.created = time.monotonic()

    # -- worker side -----------------------------------------------------------------

    def start_beating(self) -> threading.Thread:
        """Beat from a daemon thread of this (the worker's) process until it exits."""
        def beat() -> None:
            while True:
                self.value.value = time.monotonic()
                time.sleep(self.interval_s)

        thread = threading.Thread(target=beat, name="miles-heartbeat", daemon=True)
        thread.start()
        return thread

    # -- driver side -----------------------------------------------------------------

    def silent_for(self, now: float | None = None) -> float | None:
        """Seconds since the last beat when that is past ``interval_s + timeout_s`` (the
        worker is hung), else None. Before ``first_wait_s`` has passed, or before the
        first beat (the worker is still starting), never hung: start-up has its own limit."""
        now = time.monotonic() if now is None else now
        last = self.value.value
        if last <= 0.0 or now - self.created < self.first_wait_s:
            return None
        silent = now - last
        return silent if silent > self.interval_s + self.timeout_s else None

    def describe(self, silent_s: float) -> str:
        """The failure message of a worker silent for ``silent_s`` seconds."""
        return (f"sent no heartbeat for {silent_s:.1f} s (beats every --rollout-health-check-interval "
                f"{self.interval_s:g} s, --rollout-health-check-timeout {self.timeout_s:g} s): stopped or hung")
