"""The one error every worker failure turns into."""

from __future__ import annotations


#: how a worker failed, most telling first: when a collective fails, the worker that
#: died explains it better than one that stopped answering, and that one better than
#: a peer that only reported the broken collective
KINDS = ("died", "hung", "raised")


class WorkerFailed(RuntimeError):
    """A worker process died, hung past ``--worker-timeout`` or raised.

    ``worker`` names it (``rollout-0``, ``trainer-1``) so the message can say which;
    ``kind`` is one of :data:`KINDS`. ``trainer_state_unchanged``: the failure came
    before the trainer took an optimizer step of the current rollout (its state is
    still the last completed rollout's)."""

    def __init__(self, worker: str, message: str, kind: str = "raised"):
        super().__init__(f"worker {worker} {message}")
        self.worker = worker
        self.kind = kind
        self.trainer_state_unchanged = False
