"""Rollout engines that come back: ``--use-fault-tolerance`` for engine processes.

:class:`RestartingRouter` is the :class:`~miles_host.distributed.rollout_worker.RolloutRouter`
of a fault-tolerant run. Every call it makes to an engine process already finds a dead
engine (its exit code) or a hung one (no heartbeat for
``--rollout-health-check-interval`` + ``--rollout-health-check-timeout`` seconds, see
:mod:`miles_host.distributed.heartbeat`); where the plain router lets that
:class:`WorkerFailed` stop the run, this one

1. kills the engine process (a stopped process too: SIGKILL needs no cooperation);
2. starts the engine again on its device (``respawn``, from the launcher);
3. gives it the current weights through the run's own weight-sync path
   (``restore_weights``, set by the launcher: the transport's ``push`` of all the
   trainer's weights as the current version, to every engine). An engine that fails in
   a weight push is restarted the same way (:class:`RestartingTransport`): the trainer's
   weights are the ones being pushed, so the restore completes the push;
4. submits again the requests the engine had not finished, with their original sampling
   parameters (the per-sample seed included), so each sample is generated once more
   exactly as it would have been; samples of a request that the manager already received
   are dropped when they come again, so none is trained twice.

After ``abort_all`` nothing is resubmitted: those requests were being aborted anyway,
and the manager counts their samples aborted (or continues them with ``--partial-rollout``).

Each engine is restarted at most ``--max-engine-restarts`` times; the failure after that
stops the run as without fault tolerance (a checkpoint, exit code 3). A worker that
*raised* (a bad request, a bug) is not restarted: it would raise again.
``ft/engine_restarts`` in each step's metrics counts the restarts of the run so far.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from miles_host.distributed.errors import WorkerFailed
from miles_host.distributed.rollout_worker import RolloutClient, RolloutRouter

#: engine calls that load weights: a restarted engine has them from the restore
WEIGHT_LOADS = ("load_serialized", "load_shared")
#: engine calls a new engine answers again (it starts with its memory resident)
REPEATED = ("release_memory_occupation", "resume_memory_occupation")
#: kinds of failure a restart can cure
RESTARTABLE = ("died", "hung")


@dataclass
class Request:
    """A submitted request the router may have to submit again."""

    engine: int
    input_ids: list[int]
    sampling_params: dict
    return_routed_experts: bool
    #: sample indices the manager has received
    delivered: set[int] = field(default_factory=set)

    @property
    def samples(self) -> int:
        return int(self.sampling_params.get("n", 1) or 1)


class RestartingRouter(RolloutRouter):
    """A router that restarts failed engines and resubmits their unfinished requests."""

    def __init__(self, clients: list[RolloutClient], respawn: Callable[[dict[int, int]], dict[int, RolloutClient]],
                 max_restarts: int):
        super().__init__(clients)
        #: ``respawn({index: incarnation})``: started engine processes in place of those engines (started together)
        self.respawn = respawn
        self.max_restarts = max_restarts
        #: ``restore_weights()`` pushes the run's current weights to every engine (set by the launcher)
        self.restore_weights: Callable[[], Any] | None = None
        self.requests: dict[str, Request] = {}
        self.restarts = [0] * len(clients)

    # -- the backend interface --------------------------------------------------------

    def submit(self, rid, input_ids, sampling_params, return_routed_experts=False):
        index = min(range(len(self.clients)), key=lambda i: (self.load[i], i))
        request = Request(index, list(input_ids), dict(sampling_params), return_routed_experts)
        try:
            self.clients[index].submit(rid, request.input_ids, request.sampling_params, return_routed_experts)
        except WorkerFailed as failure:
            self._replace(index, failure, "submit")
            self.clients[index].submit(rid, request.input_ids, request.sampling_params, return_routed_experts)
        self.requests[rid] = request
        self.owner[rid] = index
        self.load[index] += request.samples

    def step(self):
        outputs = []
        for index, finished in enumerate(self._all("step")):
            for output in finished:
                if self._deliver(output):
                    outputs.append(output)
        return outputs

    def abort_all(self):
        outputs = [o for part in self._all("abort_all") for o in part if self._deliver(o)]
        self.requests.clear()
        self.load = [0] * len(self.clients)
        return outputs

    def step_metrics(self) -> dict:
        """``ft/engine_restarts``: the restarts of the run so far."""
        return {"ft/engine_restarts": sum(self.restarts)}

    # -- failures -----------------------------------------------------------------------

    def _deliver(self, output: dict) -> bool:
        """Record an engine output; False for a sample the manager already received (a
        resubmitted request generates its finished samples again)."""
        meta = output["meta_info"]
        rid, sample = meta["id"], meta.get("index", 0)
        request = self.requests.get(rid)
        if request is None:
            return True  # untracked (finished, or cleared by abort_all): the manager decides
        if sample in request.delivered:
            return False
        request.delivered.add(sample)
        self.load[request.engine] -= 1
        if len(request.delivered) >= request.samples:
            del self.requests[rid]
        return True

    def _all(self, method: str, *args) -> list:
        """``method`` on every engine; engines that fail are replaced and their answers are
        the replacements' (see :meth:`_answer_after_restart`)."""
        failures: dict[int, WorkerFailed] = {}
        sent = []
        for index, client in enumerate(self.clients):
            try:
                client.handle.send(method, *args)
                sent.append(index)
            except WorkerFailed as failure:
                failures[index] = failure
        results: dict[int, Any] = {}
        for index in sent:
            try:
                results[index] = self.clients[index].handle.recv(f"'{method}'")
            except WorkerFailed as failure:
                failures[index] = failure
        if failures:
            self._recover(failures, method)
            for index in failures:
                results[index] = self._answer_after_restart(index, method, args)
        return [results[index] for index in range(len(self.clients))]

    def _answer_after_restart(self, index: int, method: str, args: tuple) -> Any:
        """What the new engine ``index`` answers in place of the failed one's ``method``."""
        if method in WEIGHT_LOADS:
            return args[-1]  # the version pushed: the restore gave the new engine these weights
        if method in REPEATED:
            return self.clients[index].handle.call(method, *args)
        if method == "has_unfinished":
            return any(request.engine == index for request in self.requests.values())
        return []  # step: the resubmitted requests answer later; abort_all: nothing was left to abort

    def _replace(self, index: int, failure: WorkerFailed, method: str) -> None:
        """Replace engine ``index`` after ``failure`` in ``method`` (see :meth:`_recover`)."""
        self._recover({index: failure}, method)

    def _recover(self, failures: dict[int, WorkerFailed], method: str) -> None:
        """Kill and start again every engine in ``failures`` (all of them before any weights
        move: a weight push waits for every engine), push the current weights, then resubmit
        the unfinished requests of each (none after ``abort_all``). An engine found failed
        during the push is replaced the same way."""
        restarted: set[int] = set()
        while failures:
            # others that are down too: started in the same wait, and none left for the push to wait on
            failures.update(self._unanswered(skip=set(failures) | restarted))
            for index, failure in sorted(failures.items()):
                self._stop_failed(index, failure, method)
            self._install(self.respawn({index: self.restarts[index] for index in failures}))
            restarted.update(failures)
            failures = {}
            try:
                self.restore_weights()
            except WorkerFailed as failure:  # an engine failed under the restore's push
                failures = self.failed_in_push(failure, collective=True)
        for index in sorted(restarted):
            mine = {} if method == "abort_all" else {rid: r for rid, r in self.requests.items() if r.engine == index}
            for rid, request in mine.items():
                self.clients[index].submit(rid, request.input_ids, request.sampling_params,
                                           request.return_routed_experts)
                self.load[index] += request.samples - len(request.delivered)
            print(f"miles: rollout engine {self.clients[index].name} is back; {len(mine)} unfinished request(s) "
                  "submitted again", file=sys.stderr, flush=True)

    def _install(self, clients: dict[int, RolloutClient]) -> None:
        """Put started engines in place of failed ones."""
        for index, client in clients.items():
            self.clients[index] = client
            self.load[index] = 0

    def _stop_failed(self, index: int, failure: WorkerFailed, method: str) -> None:
        """Count a restart of engine ``index`` (failed with ``failure``) and kill it; raises
        the failure when a restart cannot cure it or the restarts are used up."""
        if failure.kind not in RESTARTABLE:
            raise failure
        if self.restarts[index] >= self.max_restarts:
            raise WorkerFailed(failure.worker, f"{_detail(failure)}; it was restarted {self.restarts[index]} time(s) "
                               f"already (--max-engine-restarts {self.max_restarts})", failure.kind) from failure
        if self.restore_weights is None:
            raise failure  # no way to give a new engine the run's weights: stop as without fault tolerance
        self.restarts[index] += 1
        print(f"miles: warning: rollout engine {failure.worker} {_detail(failure)}; restarting it (restart "
              f"{self.restarts[index]} of at most {self.max_restarts})", file=sys.stderr, flush=True)
        self.clients[index].handle.stop(0)  # SIGKILL unless it already exited

    def failed_in_push(self, failure: WorkerFailed, collective: bool) -> dict[int, WorkerFailed]:
        """The engines to restart after ``failure`` in a weight push: the one it names, and
        with a ``collective`` push (a broadcast) every other engine too, whose end of the
        broken collective is in no known state. Raises ``failure`` when it names no engine."""
        index = self._index_of(failure.worker)
        if index is None:
            raise failure
        failures = {i: WorkerFailed(client.name, "took part in a weight broadcast that failed", "hung")
                    for i, client in enumerate(self.clients)} if collective else {}
        failures[index] = failure
        return failures

    def _unanswered(self, skip: set[int]) -> dict[int, WorkerFailed]:
        """The engines (but ``skip``) that fail a ping: dead, or silent past their heartbeat."""
        failures = {}
        for index, client in enumerate(self.clients):
            if index not in skip:
                try:
                    client.handle.call("ping")
                except WorkerFailed as failure:
                    failures[index] = failure
        return failures

    def _index_of(self, worker: str) -> int | None:
        """The index of the engine named ``worker``, None for another worker."""
        names = [client.name for client in self.clients]
        return names.index(worker) if worker in names else None


def _detail(failure: WorkerFailed) -> str:
    """The failure's message without ``worker NAME``."""
    return str(failure).removeprefix(f"worker {failure.worker} ")


class RestartingTransport:
    """A weight-sync transport whose pushes survive an engine of a :class:`RestartingRouter`
    failing under them: the engine (every engine, after a failed collective: ``inner.collective``)
    is restarted and the restore pushes the trainer's weights, which are the ones this push
    carried, as its version."""

    def __init__(self, inner: Any, router: RestartingRouter):
        self.inner = inner
        self.router = router

    def push(self, named_tensors, backend: Any, weight_version: Any) -> Any:
        """``inner.push``, with a failed engine restarted."""
        try:
            return self.inner.push(named_tensors, backend, weight_version)
        except WorkerFailed as failure:
            failures = self.router.failed_in_push(failure, collective=getattr(self.inner, "collective", False))
            self.router._recover(failures, "push")
            return self.router.weight_version
