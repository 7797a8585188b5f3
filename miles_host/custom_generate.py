"""Custom generate functions (``--custom-generate-function-path``) over many trajectories at once.

A custom generate function ``fn(args, sample, sampling_params, session)`` fills one sample,
often over several turns (generate, call a tool, append its output, generate again). The
trajectories of a rollout (or of an evaluation) run concurrently in one event loop:

- an ``async def`` function runs as a task of that loop and awaits
  ``session.async_generate(...)``;
- a plain function runs in a worker thread and calls ``session.generate(...)``, which blocks
  that thread only;

at most ``--sglang-server-concurrency`` trajectories at once (slime's flag: how many requests
a rollout keeps in flight to its engines).

The rollout backend is not thread-safe, so :class:`EngineDriver` makes every backend call
(``submit``, ``step``, ``abort_all``) on one engine thread of its own and hands each output to
the trajectory that waits for it. A trajectory that raises fails its own sample (status
FAILED, the reason in ``metadata["failure"]``); the others carry on.

With ``--use-session-server`` each trajectory also gets an OpenAI base URL of its own,
``session.base_url`` and ``sample.metadata["session_url"]`` (``.../sessions/{id}/v1``),
for an unmodified agent loop written with the ``openai`` client; its requests run on the
same engine driver and are recorded token-in-token-out
(:mod:`miles_host.agentic.sessions`). When the function returns, the sample is built
from that record (tokens, loss mask, log-probs, status). A session trajectory cannot be
resumed: under ``--partial-rollout`` an aborted one starts again from its prompt.
"""

from __future__ import annotations

import asyncio
import inspect
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from miles_host.agentic.session_server import SessionHandle, SessionServer
from miles_host.agentic.sessions import Trajectory, mismatch_policy
from miles_host.sample import Sample, Status

#: the finish reason of a request aborted because the rollout's batch is full
ABORTED = {"type": "abort", "message": "aborted"}


def is_async_function(function: Callable) -> bool:
    """``async def`` functions (and objects whose ``__call__`` is one)."""
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(getattr(function, "__call__", None))


class EngineDriver:
    """Steps a rollout backend for the trajectories of one event loop.

    Every backend call runs on one engine thread; :meth:`generate` (a coroutine of the
    loop) submits a request and waits for its output while a driver task steps the
    backend as long as some request is unanswered. After :meth:`abort` every running
    request comes back with what it generated so far and finish reason ``abort``, and
    new requests are answered at once with no tokens."""

    def __init__(self, backend: Any, return_routed_experts: bool = False):
        self.backend = backend
        self.return_routed_experts = return_routed_experts
        self.aborting = False
        self.generated_tokens = 0
        self._engine = ThreadPoolExecutor(1, thread_name_prefix="miles-engine")
        self._waiting: dict[str, asyncio.Future] = {}  # rid -> future, loop thread only
        self._early: dict[str, dict] = {}  # outputs that came back before their rid was registered
        self._live: set[str] = set()  # submitted and not answered, engine thread only
        self._stopping = False
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> "EngineDriver":
        self.loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="miles-engine-driver")
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self._stopping = True
        self._wake.set()
        await self._task
        self._engine.shutdown(wait=True)
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(RuntimeError("the rollout ended while this request was waiting"))

    async def generate(self, rid: str, input_ids: list[int], sampling_params: dict) -> dict:
        """One request (``n`` 1): its SGLang-shaped output once the engine finished it.
        ``ValueError`` from the backend (a bad prompt) reaches the caller."""
        if self.aborting:
            return self.aborted_output(rid)
        await self.loop.run_in_executor(self._engine, self._submit, rid, list(input_ids), {**sampling_params, "n": 1})
        if rid in self._early:
            return self._early.pop(rid)
        future = self.loop.create_future()
        self._waiting[rid] = future
        self._wake.set()
        return await future

    def aborted_output(self, rid: str) -> dict:
        """The output of a request that was aborted before it generated anything."""
        return {"output_ids": [], "meta_info": {"id": rid, "index": 0, "finish_reason": dict(ABORTED),
                                                "output_token_logprobs": [],
                                                "weight_version": self.backend.weight_version}}

    async def abort(self) -> None:
        """Abort every running request (they return what they have); later requests are
        answered at once with no tokens."""
        self.aborting = True
        outputs = await self.loop.run_in_executor(self._engine, self._abort_all)
        self._deliver(outputs)
        for rid in list(self._waiting):
            self._resolve(rid, self.aborted_output(rid))

    def accept_requests(self) -> None:
        """After :meth:`abort`: new requests go to the engine again."""
        self.aborting = False

    async def on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the engine thread, between two backend steps (the backend is never
        used by two threads); its result."""
        return await self.loop.run_in_executor(self._engine, fn)

    # -- engine thread -----------------------------------------------------

    def _submit(self, rid: str, input_ids: list[int], params: dict) -> None:
        self.backend.submit(rid, input_ids, params, self.return_routed_experts)
        self._live.add(rid)

    def _step(self) -> tuple[list[dict], list[str]]:
        outputs = self.backend.step()
        for output in outputs:
            self._live.discard(output["meta_info"]["id"])
        lost: list[str] = []
        if self._live and not self.backend.has_unfinished():
            lost, self._live = sorted(self._live), set()
        return outputs, lost

    def _abort_all(self) -> list[dict]:
        outputs = self.backend.abort_all()
        self._live.clear()
        return outputs

    # -- loop thread -------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopping:
            if not self._waiting:
                await self._wake.wait()
                self._wake.clear()
                continue
            outputs, lost = await self.loop.run_in_executor(self._engine, self._step)
            self._deliver(outputs)
            for rid in lost:
                future = self._waiting.pop(rid, None)
                if future is not None and not future.done():
                    future.set_exception(RuntimeError(f"request {rid} finished without an output (the backend lost it)"))
            await asyncio.sleep(0)  # let trajectories submit their next turns between steps

    def _deliver(self, outputs: list[dict]) -> None:
        for output in outputs:
            self.generated_tokens += len(output["output_ids"])
            self._resolve(output["meta_info"]["id"], output)

    def _resolve(self, rid: str, output: dict) -> None:
        future = self._waiting.pop(rid, None)
        if future is None:
            self._early[rid] = output  # its trajectory registers it after the submit returns
        elif not future.done():
            future.set_result(output)


class GenerateSession:
    """What a custom generate function gets to talk to the rollout engine (one per trajectory).

    ``generate`` blocks (for plain functions, which run in worker threads);
    ``async_generate`` is its coroutine (for ``async def`` functions). Both send one request
    (``n`` 1) and return the SGLang-shaped output: ``output_ids``, ``meta_info`` with
    ``output_token_logprobs`` and ``finish_reason``. ``aborted`` turns True once a request
    came back aborted (the rollout's batch is full): the sample is then ``ABORTED`` and,
    with ``--partial-rollout``, given to the function again in the next rollout with the
    tokens it has (slime's convention)."""

    def __init__(self, manager: Any, driver: EngineDriver, rid_prefix: str):
        self.manager = manager
        self.tokenizer = manager.tokenizer
        self.driver = driver
        self.rid_prefix = rid_prefix
        self.aborted = False
        #: the trajectory's OpenAI base URL (``--use-session-server``), else None
        self.base_url: str | None = None
        self._count = 0

    def next_rid(self) -> str:
        """A request id unique in the rollout."""
        self._count += 1
        return f"{self.rid_prefix}-t{self._count}"

    async def async_generate(self, input_ids: list[int], sampling_params: dict) -> dict:
        """One request; its output once the engine finished it."""
        output = await self.driver.generate(self.next_rid(), input_ids, sampling_params)
        if (output["meta_info"].get("finish_reason") or {}).get("type") == "abort":
            self.aborted = True
        return output

    def generate(self, input_ids: list[int], sampling_params: dict) -> dict:
        """One request, blocking this (worker) thread until its output is back."""
        loop = self.driver.loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # a worker thread: no loop of its own
            running = None
        if running is loop:
            raise RuntimeError(
                "session.generate blocks and was called from an async def generate function (the event loop's "
                "thread); use `await session.async_generate(input_ids, sampling_params)` there"
            )
        return asyncio.run_coroutine_threadsafe(self.async_generate(input_ids, sampling_params), loop).result()

    def append_generation(self, sample: Sample, output: dict) -> None:
        """Append a :meth:`generate` result to the sample (trained tokens, logprobs)."""
        self.manager.apply_output(sample, output)

    def append_tokens(self, sample: Sample, token_ids: list[int], loss_mask: int = 0) -> None:
        """Append tokens the policy did not sample (tool output, user turn): not trained
        (``loss_mask`` 0) and with a 0.0 placeholder log-prob."""
        sample.tokens.extend(token_ids)
        sample.response_length += len(token_ids)
        sample.loss_mask.extend([loss_mask] * len(token_ids))
        sample.rollout_log_probs.extend([0.0] * len(token_ids))
        sample.token_weight_versions.extend([None] * len(token_ids))
        sample.response = self.tokenizer.decode(sample.tokens[sample.prompt_length :], skip_special_tokens=True)


class TrajectoryRunner:
    """Runs a custom generate function over samples in the current event loop, at most
    ``limit`` at once (plain functions in a pool of ``limit`` worker threads); with a
    ``session_server``, each trajectory in a session of its own."""

    def __init__(self, manager: Any, function: Callable, driver: EngineDriver, limit: int,
                 session_server: SessionServer | None = None):
        self.manager = manager
        self.function = function
        self.driver = driver
        self.session_server = session_server
        self.semaphore = asyncio.Semaphore(limit)
        self.threads = None if is_async_function(function) else ThreadPoolExecutor(limit, "miles-generate")

    def close(self) -> None:
        """Release the worker threads (after every trajectory returned)."""
        if self.threads is not None:
            self.threads.shutdown(wait=False)

    async def run(self, sample: Sample, sampling_params: dict, rid_prefix: str) -> Sample:
        """One trajectory; the filled sample (or the function's own), never raising."""
        session = GenerateSession(self.manager, self.driver, rid_prefix)
        async with self.semaphore:
            handle = self._open_session(session, sample, sampling_params)
            try:
                if self.threads is None:
                    result = await self.function(self.manager.config, sample, sampling_params, session)
                else:
                    result = await self.driver.loop.run_in_executor(
                        self.threads, self.function, self.manager.config, sample, sampling_params, session)
                    if inspect.isawaitable(result):
                        result = await result
                if result is not None and result is not sample:
                    if not isinstance(result, Sample):
                        raise TypeError(f"returned {type(result).__name__}; return the Sample (or None)")
                    sample = result
                if handle is not None and (handle.requests or handle.trajectory.error):
                    self._close_session(handle, sample)
                    handle.trajectory.fill_sample(sample, self._decode)
                elif session.aborted and sample.status is not Status.FAILED:
                    sample.status = Status.ABORTED
                elif sample.status in (Status.PENDING, Status.ABORTED):
                    sample.status = Status.COMPLETED
                sample.validate()
            except Exception as error:  # noqa: BLE001 - one failing trajectory must not stop the others
                sample.status = Status.FAILED
                sample.metadata["failure"] = f"custom generate: {type(error).__name__}: {error}"
            finally:
                if handle is not None:
                    self._close_session(handle, sample)
        return sample

    def _open_session(self, session: GenerateSession, sample: Sample, sampling_params: dict) -> SessionHandle | None:
        if self.session_server is None:
            return None
        if sample.response_length:  # an aborted session trajectory: agent state is gone, start again
            del sample.tokens[sample.prompt_length:]
            sample.response_length, sample.loss_mask, sample.rollout_log_probs = 0, [], []
            sample.weight_versions, sample.response, sample.rollout_routed_experts = [], "", None
            sample.token_weight_versions = []
            sampling_params = {**sampling_params, "max_new_tokens": self.manager.config.rollout_max_response_len}
        loop, driver = self.driver.loop, self.driver

        def generate(input_ids: list[int], params: dict):
            rid = session.next_rid()
            return asyncio.run_coroutine_threadsafe(driver.generate(rid, input_ids, params), loop)

        handle = SessionHandle(SessionServer.new_session_id(),
                               Trajectory(mismatch_policy(self.manager.config.session_prefix_mismatch)),
                               generate, dict(sampling_params))
        session.base_url = self.session_server.open(handle)
        sample.metadata["session_url"] = session.base_url
        sample.metadata["session_id"] = handle.session_id
        return handle

    def _close_session(self, handle: SessionHandle, sample: Sample) -> None:
        self.session_server.close(handle.session_id)
        sample.metadata.pop("session_url", None)

    def _decode(self, ids: list[int]) -> str:
        return self.manager.tokenizer.decode(ids, skip_special_tokens=True)
