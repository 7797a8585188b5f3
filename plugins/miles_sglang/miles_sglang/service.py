"""The engine behind ``miles serve``: one thread owns the engine and steps it.

The embedded :class:`~miles_host.rollout.Engine` is single-threaded. The HTTP
server (an asyncio loop) never touches it: it hands closures to the engine thread
(:meth:`EngineWorker.call_async`, run between steps) and awaits a
:class:`GenerateJob` for results or stream chunks (:func:`wait_job`,
:func:`iter_chunks`), woken by the job's ``notify`` callback, so no event-loop
thread ever blocks on the engine. While requests are in flight the thread steps
the engine; when idle it sleeps on the command queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import pluggy

from miles_host import hookspecs
from miles_host.rollout.outputs import sglang_logprob_meta
from miles_host.routing import RoutingHooks
from miles_sglang.protocol import encode_routed_experts

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


class _RouteCapture:
    """Captures each MoE layer's experts in rollout forwards that ask for them
    (the engine sets ``routing_context.extra["capture"]`` for ``return_routed_experts``)."""

    @hookspecs.hookimpl
    def miles_experts_selected(self, layer_index, expert_ids, routing_context):
        if routing_context.phase == "rollout" and routing_context.extra.get("capture"):
            routing_context.captured[layer_index] = expert_ids.detach()


def capture_routing_hooks() -> RoutingHooks:
    """Routing hooks whose only plugin records routes, so ``return_routed_experts`` works
    without the r3 plugin (its own manager: no other plugin's hooks run in the server)."""
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    manager.register(_RouteCapture(), name="miles-serve-route-capture")
    return RoutingHooks(manager.hook)


@dataclass(frozen=True)
class LogprobRequest:
    """One prompt's logprob fields of ``/generate`` (SGLang's names and defaults)."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None


@dataclass
class GenerateJob:
    """One ``/generate`` call: its samples, their results and (streaming) chunks.

    The logprob fields apply to every prompt unless ``per_prompt`` has the prompt's
    own (a batch whose ``return_logprob`` / ``top_logprobs_num`` / ... are lists)."""

    keys: list[tuple[str, int]]
    prompts: dict[str, list[int]]
    return_logprob: bool
    return_routed_experts: bool
    logprob_start_len: int
    stream: bool
    incremental: bool
    #: SGLang's ``top_logprobs_num``: the top alternatives of each generated token (with ``return_logprob``)
    top_logprobs_num: int = 0
    #: SGLang's ``token_ids_logprob``: these ids' logprobs at each generated position (with ``return_logprob``)
    token_ids_logprob: list[int] | None = None
    #: SGLang's ``return_text_in_logprobs``: each logprob entry's token decoded, not ``None``
    return_text_in_logprobs: bool = False
    #: SGLang's ``routed_experts_start_len``: routes from this row on (earlier rows the caller has)
    routed_experts_start_len: int = 0
    #: rid -> that prompt's logprob fields, where a batch gives them per prompt
    per_prompt: dict[str, LogprobRequest] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    results: dict[tuple[str, int], dict] = field(default_factory=dict)
    chunks: "queue.Queue[dict | None]" = field(default_factory=queue.Queue)
    done: threading.Event = field(default_factory=threading.Event)
    sent_tokens: dict[tuple[str, int], int] = field(default_factory=dict)
    sent_text: dict[tuple[str, int], int] = field(default_factory=dict)
    #: called from the engine thread after each new result or chunk (wakes an awaiting loop)
    notify: Callable[[], None] | None = None

    def logprob_request(self, rid: str) -> LogprobRequest:
        """The logprob fields of prompt ``rid``."""
        own = self.per_prompt.get(rid)
        if own is not None:
            return own
        return LogprobRequest(self.return_logprob, self.logprob_start_len, self.top_logprobs_num,
                              self.token_ids_logprob)

    def ordered_results(self) -> list[dict]:
        """Results in request order (prompt-major, then sample index)."""
        return [self.results[key] for key in self.keys]

    def wake(self) -> None:
        if self.notify is not None:
            self.notify()

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
        """An event the engine thread sets (thread-safely) whenever this job progresses."""
        event = asyncio.Event()

        def notify() -> None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop has closed: nobody is waiting any more
                pass

        self.notify = notify
        return event


@dataclass
class ServerState:
    """What the endpoints share: the engine worker and the server's settings."""

    worker: EngineWorker
    model_path: str
    api_key: str | None = None
    incremental_streaming_output: bool = False
    server_args: dict[str, Any] = field(default_factory=dict)
    family: Any = None
    released_tags: set[str] = field(default_factory=set)
    weight_groups: dict[str, Any] = field(default_factory=dict)

    @property
    def weight_version(self) -> str:
        """The engine's weight version, as SGLang spells it (a string)."""
        return str(self.worker.engine.weight_version)


def new_rid() -> str:
    """A fresh request id (SGLang's are uuid4 hex)."""
    return uuid.uuid4().hex


class EngineWorker:
    """Owns the engine in a background thread; other threads call into it."""

    def __init__(self, engine: Any):
        self.engine = engine
        self._commands: "queue.Queue[tuple[Callable, concurrent.futures.Future]]" = queue.Queue()
        self._jobs: dict[str, GenerateJob] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="miles-serve-engine", daemon=True)

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> "EngineWorker":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is in flight and end the thread."""
        if self._thread.is_alive():
            try:
                self.call(lambda engine: self.abort_here(None, "server shutting down"), timeout=timeout)
            except Exception:  # noqa: BLE001 - stopping anyway
                pass
        self._stop.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    # -- calls from other threads ---------------------------------------------

    def call_future(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Queue ``fn(engine)`` for the engine thread; a future of its result."""
        if not self.alive:
            raise RuntimeError("the engine thread is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        return future

    def call(self, fn: Callable[[Any], Any], timeout: float | None = 600.0) -> Any:
        """Run ``fn(engine)`` in the engine thread; its result (or its exception). Blocks."""
        return self.call_future(fn).result(timeout)

    def call_async(self, fn: Callable[[Any], Any]) -> Awaitable[Any]:
        """``fn(engine)`` run in the engine thread, awaited without blocking the event loop."""
        return asyncio.wrap_future(self.call_future(fn))

    def submit(self, job: GenerateJob, prompts: list[list[int]], params: list[dict], rids: list[str]) -> None:
        """Queue the job's requests (ValueError for a bad one: none of them is queued). Blocks."""
        self.call(self._adder(job, prompts, params, rids))

    def submit_async(self, job: GenerateJob, prompts: list[list[int]], params: list[dict],
                     rids: list[str]) -> Awaitable[None]:
        """:meth:`submit`, awaited from an event loop."""
        return self.call_async(self._adder(job, prompts, params, rids))

    def load(self) -> dict[str, Any]:
        """Running and waiting samples and KV-cache use, read in the engine thread (call it there)."""
        engine = self.engine
        scheduler, blocks = engine.scheduler, engine.block_manager
        waiting = sum(1 + len(getattr(seq, "children", None) or ()) for seq in scheduler.waiting)
        used_tokens = (blocks.num_usable_blocks - blocks.num_free_blocks) * blocks.block_size
        return {"num_running_reqs": len(scheduler.running), "num_waiting_reqs": waiting,
                "num_used_tokens": used_tokens, "max_total_num_tokens": engine.num_kv_cache_tokens,
                "max_running_requests": engine.config.max_num_seqs, "paused": engine.paused}

    def _adder(self, job: GenerateJob, prompts: list[list[int]], params: list[dict],
               rids: list[str]) -> Callable[[Any], None]:

        def add(engine):
            added = []
            try:
                for prompt, sampling, rid in zip(prompts, params, rids):
                    if rid in self._jobs:
                        raise ValueError(f"request id {rid!r} is already in use")
                    asked = job.logprob_request(rid)
                    options = dict(return_logprob=asked.return_logprob,
                                   return_routed_experts=job.return_routed_experts,
                                   top_logprobs_num=asked.top_logprobs_num,
                                   token_ids_logprob=asked.token_ids_logprob,
                                   logprob_start_len=asked.logprob_start_len)
                    if sampling.get("max_new_tokens") == 0:
                        # finishes at once; generate() hands back the result add_request would drop
                        outputs = engine.generate(prompt, sampling, rid=rid, **options)
                        reason = outputs[0]["meta_info"]["finish_reason"] if outputs else None
                        if reason and reason.get("type") == "abort" and reason.get("message") != "aborted":
                            raise ValueError(reason["message"])  # generate() answers a bad request this way
                        self._jobs[rid] = job
                        added.append(rid)
                        self._deliver(outputs)
                        continue
                    engine.add_request(rid, prompt, sampling, **options)
                    self._jobs[rid] = job
                    added.append(rid)
            except (ValueError, RuntimeError):
                for rid in added:
                    engine.abort(rid)
                    self._jobs.pop(rid, None)
                raise

        return add

    def abort(self, rid: str | None, message: str = "aborted") -> int:
        """Abort one request (or all); how many samples were stopped."""
        return self.call(lambda engine: self.abort_here(rid, message))

    # -- the engine thread ---------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            busy = self.engine.has_unfinished() and not self.engine.paused
            self._run_commands(block=not busy)
            if not (self.engine.has_unfinished() and not self.engine.paused):
                continue
            try:
                finished = self.engine.step()
            except Exception as error:  # noqa: BLE001 - fail the requests, keep serving
                logger.exception("engine step failed")
                self.abort_here(None, f"engine error: {type(error).__name__}: {error}")
                continue
            self._deliver(finished)
            self._stream_progress()

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as error:  # noqa: BLE001 - handed to the caller
                    future.set_exception(error)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def abort_here(self, rid: str | None, message: str) -> int:
        """Abort in the engine thread (from inside :meth:`call`); deliver the partial outputs."""
        outputs = self.engine.abort(rid)
        if message != "aborted":
            for output in outputs:
                output["meta_info"]["finish_reason"] = {"type": "abort", "message": message}
        self._deliver(outputs)
        return len(outputs)

    def _deliver(self, outputs: list[dict]) -> None:
        for output in outputs:
            meta = output["meta_info"]
            job = self._jobs.get(meta["id"])
            if job is None:
                continue
            key = (meta["id"], meta.get("index", 0))
            wire = self._to_wire(job, output)
            job.results[key] = wire
            if job.stream:
                job.chunks.put(self._chunk(job, key, wire, final=True))
            if all(k in job.results for k in job.keys):
                for rid in job.prompts:
                    self._jobs.pop(rid, None)
                job.done.set()
                if job.stream:
                    job.chunks.put(None)
            job.wake()

    def _stream_progress(self) -> None:
        streaming = {rid: job for rid, job in self._jobs.items() if job.stream}
        if not streaming:
            return
        for rid, job in streaming.items():
            for partial in self.engine.progress(rid, return_logprob=job.logprob_request(rid).return_logprob):
                key = (rid, partial["meta_info"]["index"])
                if key in job.results or len(partial["output_ids"]) <= job.sent_tokens.get(key, 0):
                    continue
                job.chunks.put(self._chunk(job, key, self._to_wire(job, partial, final=False), final=False))
                job.wake()

    # -- response shapes -----------------------------------------------------------

    def _to_wire(self, job: GenerateJob, output: dict, final: bool = True) -> dict:
        """An engine output in SGLang's wire layout (``meta_info`` as its tokenizer manager
        builds it): logprob triples ``[logprob, token id, text or None]``, the weight
        version a string, routes base64, ``e2e_latency``."""
        meta = dict(output["meta_info"])
        asked = job.logprob_request(meta["id"])
        if asked.return_logprob and "output_token_logprobs" in meta:
            meta.update(self._logprob_meta(job, asked, output))
        else:
            meta.pop("output_token_logprobs", None)
        output = {k: v for k, v in output.items() if k != "logprobs"}
        if meta.get("weight_version") is not None:
            meta["weight_version"] = str(meta["weight_version"])  # SGLang's weight versions are strings
        if "routed_experts" in meta:
            routes = meta["routed_experts"]
            if routes is not None and job.routed_experts_start_len:
                routes = routes[job.routed_experts_start_len:]
                meta["routed_experts_start_len"] = job.routed_experts_start_len
            meta["routed_experts"] = encode_routed_experts(routes)
        meta["e2e_latency"] = time.time() - job.created
        return {**output, "meta_info": meta}

    def _logprob_meta(self, job: GenerateJob, asked: LogprobRequest, output: dict) -> dict:
        """SGLang's logprob fields. With ``logprob_start_len`` -1 SGLang starts the prompt's
        logprobs at its last token (``len(input_ids) - 1``), which has none: one
        ``[None, last prompt id, text]`` entry (and ``None`` top / requested-id rows)."""
        tokenizer = self.engine.tokenizer
        rendered = sglang_logprob_meta(output, tokenizer, job.return_text_in_logprobs)
        if asked.logprob_start_len < 0:
            prompt = job.prompts[output["meta_info"]["id"]]
            text = tokenizer.decode([prompt[-1]]) if job.return_text_in_logprobs else None
            rendered["input_token_logprobs"] = [[None, prompt[-1], text]]
            for side in ("top_logprobs", "token_ids_logprobs"):
                if f"output_{side}" in rendered:
                    rendered[f"input_{side}"] = [None]
        return rendered

    def _chunk(self, job: GenerateJob, key: tuple[str, int], wire: dict, final: bool) -> dict:
        """SGLang's default stream chunks are cumulative; ``incremental`` sends deltas (the
        prompt's logprobs in the first chunk only)."""
        chunk = {**wire, "index": job.keys.index(key)}
        if job.incremental:
            start = job.sent_tokens.get(key, 0)
            meta = dict(wire["meta_info"])
            chunk["output_ids"] = wire["output_ids"][start:]
            for name in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
                if name in meta:
                    meta[name] = meta[name][start:]
            if key in job.sent_tokens:
                for name in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
                    if name in meta:
                        meta[name] = []
            chunk["meta_info"] = meta
            if "text" in wire:
                chunk["text"] = wire["text"][job.sent_text.get(key, 0):]
                job.sent_text[key] = len(wire["text"])
        job.sent_tokens[key] = len(wire["output_ids"])
        return chunk


# ----------------------------------------------------------------------------
# awaiting a job from the server's event loop
# ----------------------------------------------------------------------------

_POLL_S = 1.0


async def _progress(job: GenerateJob, event: asyncio.Event, worker: EngineWorker,
                    is_disconnected: Callable[[], Awaitable[bool]] | None) -> None:
    """Wait until the engine thread signals progress (or a poll interval passes);
    RuntimeError if the engine thread died, ConnectionAbortedError if the client left."""
    try:
        await asyncio.wait_for(event.wait(), _POLL_S)
    except asyncio.TimeoutError:
        if not worker.alive:
            raise RuntimeError("the engine thread stopped") from None
        if is_disconnected is not None and await is_disconnected():
            raise ConnectionAbortedError("the client went away") from None
    event.clear()


async def wait_job(job: GenerateJob, worker: EngineWorker, event: asyncio.Event,
                   is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> list[dict]:
    """The job's results in request order, once all are in. A client that goes away
    aborts the job's requests (as SGLang does) and raises ConnectionAbortedError."""
    try:
        while not job.done.is_set():
            await _progress(job, event, worker, is_disconnected)
    except (ConnectionAbortedError, asyncio.CancelledError):
        abort_job(job, worker)
        raise
    return job.ordered_results()


async def iter_chunks(job: GenerateJob, worker: EngineWorker, event: asyncio.Event) -> AsyncIterator[dict]:
    """The stream chunks of a ``stream`` job as they come; its requests are aborted
    if the consumer stops early (the client disconnected)."""
    finished = False
    try:
        while True:
            while True:
                try:
                    chunk = job.chunks.get_nowait()
                except queue.Empty:
                    break
                if chunk is None:
                    finished = True
                    return
                yield chunk
            await _progress(job, event, worker, None)
    finally:
        if not finished:
            abort_job(job, worker)


def abort_job(job: GenerateJob, worker: EngineWorker) -> None:
    """Queue the abort of every request of ``job`` still running (does not wait: safe in
    ``finally`` blocks of cancelled tasks and closed generators)."""
    if not worker.alive or job.done.is_set():
        return
    for rid in job.prompts:
        try:
            worker.call_future(lambda engine, rid=rid: worker.abort_here(rid, "aborted"))
        except RuntimeError:
            return
