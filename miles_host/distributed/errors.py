"""The one error every worker failure turns into."""

from __future__ import annotations


class WorkerFailed(RuntimeError):
    """A worker process died, hung past ``--worker-timeout`` or raised.

    ``worker`` names it (``rollout-0``, ``trainer-1``) so the message can say which."""

    def __init__(self, worker: str, message: str):
        super().__init__(f"worker {worker} {message}")
        self.worker = worker
