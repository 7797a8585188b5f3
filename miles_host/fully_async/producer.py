"""The rollout producer of ``--fully-async``: one thread that keeps the engines generating.

It owns the rollout backend while the run trains: it starts groups (continued ones,
prompts to generate again, then new prompts) while fewer than
``--async-max-concurrent-samples`` samples are generating and the finished-group
buffer has room, steps the backend, scores and filters each group that finishes (the
rollout manager's code, as in a synchronous rollout) and puts it in the buffer.

Everything else that needs the backend (weight pushes, evaluation, checkpoint
snapshots) is handed to the producer with :meth:`RolloutProducer.call` and runs on its
thread between two engine steps, so the backend is never used by two threads. A call
says what happens to the requests in flight (``--pause-generation-mode``):

``in_place``
    they stay in the engine with their KV cache and continue afterwards; the engine
    records which weights generated each token (``weight_version_spans``).
``retract``
    they are aborted with the tokens they have and continue as new requests afterwards
    (prefilled again): each token keeps the version of the weights that generated it.
``abort``
    they are aborted and their groups go to ``--async-unused-samples-handler``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

from miles_host.fully_async.buffer import FinishedGroups
from miles_host.fully_async.streams import ProducerStream
from miles_host.rollout_manager import RolloutManager, RolloutStats
from miles_host.sample import Sample, Status

#: pause modes of :meth:`RolloutProducer.call`
PAUSE_MODES = ("in_place", "retract", "abort")


class RolloutProducer:
    """Generates groups into a :class:`FinishedGroups` buffer on a thread of its own."""

    def __init__(self, manager: RolloutManager, buffer: FinishedGroups, config: Any):
        self.manager = manager
        self.backend = manager.backend
        self.buffer = buffer
        self.config = config
        self.max_samples = config.async_max_concurrent_samples or config.rollout_batch_size * config.n_samples_per_prompt
        self.group_size = config.n_samples_per_prompt
        #: (rid, index) -> (group, position) of samples generating
        self.in_flight: dict[tuple[str, int], tuple[list[Sample], int]] = {}
        #: group_index -> group with samples generating
        self.waiting: dict[int, list[Sample]] = {}
        #: groups with unfinished samples to submit again (retracted, or restored from a checkpoint)
        self.to_continue: deque[list[Sample]] = deque()
        #: prompt indices to generate again (``--async-unused-samples-handler retry``)
        self.retry: deque[int] = deque()
        #: the weight version new requests are generated with (for their seeds and ids)
        self.version = 0
        self._segment = 0  # bumped at every retract, so continued requests get new ids
        self._stats = RolloutStats()
        self._lock = threading.Lock()  # guards _stats and retry
        self._commands: deque[tuple[Callable[[], Any], str, Future]] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._filtered_in_a_row = 0
        self._records: dict[int, Any] | None = None
        #: the CUDA stream the producer's engine work goes to (an in-process engine on a GPU)
        self.stream = ProducerStream.for_backend(self.backend)
        #: seconds the engines had nothing to generate (buffer full, nothing to start) or were paused by a call
        self.idle_s = 0.0

    # -- control (the trainer's thread) -----------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="miles-rollout-producer", daemon=True)
            self._thread.start()

    def call(self, fn: Callable[[], Any], mode: str = "in_place") -> Any:
        """Run ``fn`` on the producer's thread between two engine steps, requests in flight
        handled by ``mode`` (:data:`PAUSE_MODES`); its result. Without a running producer
        (not started, stopped, or failed) ``fn`` runs here, the requests in flight
        stopped first unless ``mode`` is ``in_place``."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: expected one of {', '.join(PAUSE_MODES)}")
        if not self.running:
            self._pause(mode, engine_alive=self._thread is None)
            return fn()
        future: Future = Future()
        self._commands.append((fn, mode, future))
        self._wake.set()
        while True:
            try:
                return future.result(timeout=0.2)
            except FutureTimeout:
                if not self.running and not future.done():
                    raise RuntimeError("the rollout producer stopped before running the call") from None

    def stop(self) -> None:
        """Stop generating: the requests in flight are retracted (kept, with their tokens, for
        :meth:`state_dict`) and the thread ends."""
        if self.running:
            try:
                self.call(lambda: None, "retract")
            except Exception:  # noqa: BLE001 - stopping anyway; the failure is the buffer's to report
                pass
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def samples_in_flight(self) -> int:
        """Samples generating now."""
        return len(self.in_flight)

    def pop_stats(self) -> RolloutStats:
        """The counts since the last call (groups submitted, filtered, failed, tokens generated;
        ``extra["engine_idle_s"]``: seconds the engines idled)."""
        with self._lock:
            stats, self._stats = self._stats, RolloutStats()
            stats.extra["engine_idle_s"], self.idle_s = self.idle_s, 0.0
        return stats

    def recycle(self, group: list[Sample], why: str) -> None:
        """A finished group that will not be trained: generated again (``retry``) or dropped
        (``drop``, counted)."""
        with self._lock:
            if self.config.async_unused_samples_handler == "retry":
                self.retry.append(int(group[0].metadata["prompt_index"]))
            else:
                self._stats.dropped_samples += len(group)
        self._wake.set()

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything generated and not yet trained: finished groups, unfinished ones (their
        tokens so far), prompts to generate again. Call it through :meth:`call` with
        ``retract`` (or once the producer stopped), so nothing is in flight."""
        with self._lock:
            retry = list(self.retry)
        return {
            "finished": [[s.to_dict() for s in g] for g in self.buffer.snapshot()],
            "unfinished": [[s.to_dict() for s in g] for g in self.to_continue],
            "retry": retry,
            "next_group_index": self.manager.next_group_index,
        }

    def load_state_dict(self, state: dict) -> None:
        for group in state.get("finished", []):
            self.buffer.put([Sample.from_dict(s) for s in group])
        self.to_continue.extend([Sample.from_dict(s) for s in group] for group in state.get("unfinished", []))
        self.retry.extend(int(i) for i in state.get("retry", []))
        self.manager.next_group_index = int(state["next_group_index"])

    # -- the producer's thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            with self.stream.context():
                self._generate()
        except BaseException as error:  # noqa: BLE001 - the trainer's thread re-raises it
            self.buffer.fail(error)
            self._fail_commands(error)
        else:
            self._fail_commands(RuntimeError("the rollout producer stopped"))

    def _generate(self) -> None:
        while not self._stop.is_set():
            self._serve_commands()
            self._start_groups()
            if self.in_flight:
                self._step()
            else:
                started = time.perf_counter()
                self._wake.wait(0.05)
                self._wake.clear()
                self._add_idle(time.perf_counter() - started)

    def _add_idle(self, seconds: float) -> None:
        with self._lock:
            self.idle_s += seconds

    def _fail_commands(self, error: BaseException) -> None:
        while self._commands:
            _, _, future = self._commands.popleft()
            future.set_exception(error)

    def _serve_commands(self) -> None:
        """Run the calls waiting; one that fails (a weight push to a dead engine, say) is
        handed to its caller and stops the producer: the backend may be broken."""
        while self._commands:
            fn, mode, future = self._commands.popleft()
            started = time.perf_counter()
            try:
                self._pause(mode)
                future.set_result(self.stream.after_trainer(fn))
            except BaseException as error:
                future.set_exception(error)
                raise
            finally:
                self._add_idle(time.perf_counter() - started)

    def _room(self) -> bool:
        return len(self.in_flight) + self.group_size <= self.max_samples and not self.buffer.full

    def _start_groups(self) -> None:
        while self._room():
            if self.to_continue:
                group = self.to_continue.popleft()
            else:
                group = self.manager.new_group(self._next_record(), self.version)
            finished: list[list[Sample]] = []
            with self._lock:
                self._stats.submitted_groups += int(all(s.status is Status.PENDING and not s.response_length
                                                        for s in group))
                self.manager.submit_group(group, f"v{self.version}.{self._segment}", self.in_flight, self.waiting,
                                           finished, self._stats)
            for done in finished:  # every sample failed at submission
                self._keep(done)

    def _next_record(self) -> Any:
        with self._lock:
            index = self.retry.popleft() if self.retry else None
        if index is None:
            return self.manager.dataset.next_batch(1)[0]
        if self._records is None:
            self._records = {record.index: record for record in self.manager.dataset.prompts}
        return self._records[index]

    def _step(self) -> None:
        outputs = self.backend.step()
        finished: list[list[Sample]] = []
        with self._lock:
            filtered_before = self._stats.filtered_groups
            for output in outputs:
                self.manager.absorb(output, self.in_flight, self.waiting, finished, self._stats)
            filtered = self._stats.filtered_groups - filtered_before
        for group in finished:
            self._keep(group)
        if not finished and filtered:
            self._check_filter(filtered)

    def _keep(self, group: list[Sample]) -> None:
        self._filtered_in_a_row = 0
        self.buffer.put(group)

    def _check_filter(self, filtered: int) -> None:
        """A dynamic sampling filter that drops every group would keep the trainer waiting
        forever: stop with the reason instead."""
        self._filtered_in_a_row += filtered
        limit = max(64 * self.config.rollout_batch_size, 1024)
        if self._filtered_in_a_row > limit:
            raise RuntimeError(
                f"--fully-async: {self._filtered_in_a_row} groups in a row were filtered by dynamic sampling and "
                "none kept; the filter drops nearly everything: check the reward or the "
                "--dynamic-sampling-filter-path function")

    def _pause(self, mode: str, engine_alive: bool = True) -> None:
        """Stop the requests in flight as ``mode`` says (``in_place``: leave them)."""
        if mode == "in_place" or not (self.in_flight or self.waiting):
            return
        outputs = self.backend.abort_all() if engine_alive else []
        for output in outputs:
            key = (output["meta_info"]["id"], output["meta_info"].get("index", 0))
            if key in self.in_flight:
                group, position = self.in_flight.pop(key)
                self.manager.apply_output(group[position], output)
                if group[position].status is Status.COMPLETED:
                    group[position].status = Status.ABORTED
        groups = list(self.waiting.values())
        self.in_flight.clear()
        self.waiting.clear()
        self._segment += 1
        for group in groups:
            for sample in group:
                if sample.status is Status.PENDING:
                    sample.status = Status.ABORTED
            if mode == "abort":
                self.recycle(group, "aborted")
            else:
                self.to_continue.append(group)
