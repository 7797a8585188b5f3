"""Several SGLang servers behind the ``sglang`` backend, and what happens when one goes.

:class:`ServerPool` hands out the live servers in turn. Without ``--use-fault-tolerance``
every server stays in the pool whatever happens (a request to a server that is down comes
back as a FAILED sample, as before). With it:

- a request whose server does not answer (refused, reset or timed out after the client's
  retries) is sent again to another live server, and that server is dropped from the pool
  with a warning;
- a health checker thread asks each live server for ``/health_generate`` every
  ``--rollout-health-check-interval`` seconds (after ``--rollout-health-check-first-wait``)
  and drops one that gives no answer within ``--rollout-health-check-timeout``: a server
  that stopped (SIGSTOP) or hangs. The requests waiting on it move to another server at
  once; their calls to the dropped one are abandoned.

A request sent again carries its own sampling parameters (the per-sample seed too), so
it generates the sample it would have generated. The last live server is never dropped:
with none left the requests fail and the run stops on its failed samples. A dropped
server stays out for the rest of the run: its weights are no longer the run's.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import sys
import threading
from typing import Any, Callable

from miles_sglang.client import SGLangClient, SGLangUnavailableError

#: seconds between two looks at whether the server of a waiting request was dropped
_POLL_S = 0.1


class ServerPool:
    """The live servers of one backend (the list :attr:`live` is changed in place)."""

    def __init__(self, clients: list[SGLangClient], config: Any):
        self.live = clients
        self.fault_tolerant = bool(getattr(config, "use_fault_tolerance", False))
        self.interval_s = float(getattr(config, "rollout_health_check_interval", 30.0))
        self.timeout_s = float(getattr(config, "rollout_health_check_timeout", 30.0))
        self.first_wait_s = float(getattr(config, "rollout_health_check_first_wait", 0.0))
        self.dropped: list[str] = []
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._calls: concurrent.futures.ThreadPoolExecutor | None = None
        if self.fault_tolerant:
            self._calls = concurrent.futures.ThreadPoolExecutor(max(4, 2 * int(getattr(config, "sglang_concurrency", 8))),
                                                                thread_name_prefix="sglang-call")
            threading.Thread(target=self._check_health, name="sglang-health", daemon=True).start()

    def pick(self) -> SGLangClient:
        """The next live server in turn."""
        with self._lock:
            return self.live[next(self._turn) % len(self.live)]

    def call(self, request: Callable[[SGLangClient], Any], client: SGLangClient) -> Any:
        """``request(client)``; with fault tolerance, on another server (and ``client``
        dropped) when ``client`` does not answer or is dropped while the request waits."""
        if not self.fault_tolerant:
            return request(client)
        while True:
            future = self._calls.submit(request, client)
            while not concurrent.futures.wait([future], timeout=_POLL_S).done:
                if client not in self.live:
                    break  # dropped by the health checker: the call is abandoned
            else:
                try:
                    return future.result()
                except SGLangUnavailableError as error:
                    if not self.drop(client, str(error)):
                        raise
            client = self.pick()

    def drop(self, client: SGLangClient, reason: str) -> bool:
        """Take ``client`` out of the pool with a warning; False (and it stays) when it is the
        last live server. True when it is out (already, or now)."""
        with self._lock:
            if client not in self.live:
                return True
            if len(self.live) == 1:
                print(f"miles: warning: SGLang server {client.url} does not answer ({reason}) and is the last one "
                      "left; its requests fail", file=sys.stderr, flush=True)
                return False
            self.live.remove(client)
            self.dropped.append(client.url)
            left = ", ".join(c.url for c in self.live)
        print(f"miles: warning: SGLang server {client.url} does not answer ({reason}); dropped from the router "
              f"(--use-fault-tolerance), requests go to {left}", file=sys.stderr, flush=True)
        return True

    def close(self) -> None:
        """Stop the health checker and abandon the calls still waiting."""
        self._stopped.set()
        if self._calls is not None:
            self._calls.shutdown(wait=False, cancel_futures=True)

    def _check_health(self) -> None:
        if self._stopped.wait(self.first_wait_s):
            return
        while not self._stopped.wait(self.interval_s):
            for client in list(self.live):
                try:
                    client.request("GET", "/health_generate", timeout=self.timeout_s, retries=0)
                except Exception as error:  # noqa: BLE001 - any failure to answer is a failed check
                    if not self._stopped.is_set():
                        self.drop(client, f"/health_generate: {type(error).__name__}: {error}")
