"""Which worker broke a collective.

When a collective (a gradient all-reduce, a weight broadcast, the rendezvous of a
process group) fails in the driver, the error names no process: gloo says
``Connection reset by peer`` or times out, the store says ``DistStoreError``. The
workers that took part each have a request pending on their pipe (``train``,
``receive_broadcast``, their start-up answer); :func:`failed_worker` asks them, and
names the one that died, else the one that does not answer (stopped or hung), else
one that reported an error.
"""

from __future__ import annotations

from typing import Iterable

from miles_host.distributed.comm import WorkerHandle
from miles_host.distributed.errors import KINDS, WorkerFailed

#: seconds a live worker gets to report its side of a failed collective
REPLY_TIMEOUT_S = 10.0


def failed_worker(
    handles: Iterable[WorkerHandle], what: str, error: BaseException, fallback: str, reply_timeout_s: float | None = None
) -> WorkerFailed:
    """The :class:`WorkerFailed` that explains ``error`` (a collective over ``handles``'
    workers and this process failed while they were answering ``what``); ``fallback``
    (this process's own name) when every worker answered."""
    handles = list(handles)
    found: list[WorkerFailed] = []
    for handle in handles:  # a dead worker is the best explanation, and costs no waiting
        try:
            handle._check_alive(grace=True)
        except WorkerFailed as failed:
            found.append(_with_last_words(handle, failed))
    if not found:
        wait = reply_timeout_s
        if wait is None:
            wait = min(REPLY_TIMEOUT_S, max(1.0, min(h.timeout_s for h in handles))) if handles else REPLY_TIMEOUT_S
        for handle in handles:
            try:
                handle.recv(what, timeout_s=wait)
            except WorkerFailed as failed:
                found.append(failed)
    if not found:
        return WorkerFailed(fallback, f"failed in a collective ({what}): {error}", "raised")
    culprit = min(found, key=lambda failed: KINDS.index(failed.kind))
    result = WorkerFailed(culprit.worker, f"{str(culprit).removeprefix(f'worker {culprit.worker} ')}; "
                          f"the collective ({what}) failed with: {_first_line(error)}", culprit.kind)
    return result


def _with_last_words(handle: WorkerHandle, failed: WorkerFailed) -> WorkerFailed:
    """``failed`` (a dead worker) with the error it sent before it exited, if any."""
    try:
        if handle.conn.poll(0):
            status, payload = handle.conn.recv()
            if status == "error":
                detail = str(failed).removeprefix(f"worker {failed.worker} ")
                return WorkerFailed(failed.worker, f"{detail} after raising:\n{payload}", "died")
    except (EOFError, OSError, ValueError):
        pass
    return failed


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
