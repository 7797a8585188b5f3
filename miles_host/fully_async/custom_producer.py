"""The ``--fully-async`` producer for ``--custom-generate-function-path`` functions.

The same contract as :class:`~miles_host.fully_async.producer.RolloutProducer`, with
trajectories instead of engine requests: the producer's thread runs an event loop in
which the function's trajectories run concurrently (:mod:`miles_host.custom_generate`),
a new group starting whenever the sample budget and the buffer allow. Calls run on the
engine thread of the loop's :class:`~miles_host.custom_generate.EngineDriver`, between
two backend steps. A weight update leaves the trajectories running (``in_place``: each
token keeps the version that generated it). A ``retract`` call (evaluation, checkpoint
snapshots) aborts the requests in flight; the trajectories return their samples
``ABORTED`` and those groups start again afterwards with the function called on the
samples as they are (slime's partial-rollout convention).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from miles_host.custom_generate import EngineDriver, TrajectoryRunner
from miles_host.fully_async.producer import RolloutProducer
from miles_host.sample import Sample, Status


class CustomGenerateProducer(RolloutProducer):
    """A :class:`RolloutProducer` whose samples come from a custom generate function."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        #: the task of each group whose trajectories are running
        self.running_groups: dict[asyncio.Task, list[Sample]] = {}

    def _run(self) -> None:
        try:
            asyncio.run(self._run_trajectories())
        except BaseException as error:  # noqa: BLE001 - the trainer's thread re-raises it
            self.buffer.fail(error)
            self._fail_commands(error)
        else:
            self._fail_commands(RuntimeError("the rollout producer stopped"))

    async def _run_trajectories(self) -> None:
        manager, config = self.manager, self.config
        async with EngineDriver(self.backend, config.rollout_return_routed_experts) as driver:
            await driver.on_engine_thread(self.stream.use_on_this_thread)  # the driver steps the engine there
            runner = TrajectoryRunner(manager, manager.custom_generate, driver, config.sglang_server_concurrency,
                                      manager.sessions())
            try:
                while not self._stop.is_set():
                    await self._serve_calls(driver)
                    self._start_trajectories(runner)
                    if not self.running_groups:
                        started = time.perf_counter()
                        await asyncio.to_thread(self._wake.wait, 0.05)
                        self._wake.clear()
                        self._add_idle(time.perf_counter() - started)
                        continue
                    done, _ = await asyncio.wait(self.running_groups, timeout=0.05,
                                                 return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        await self._collect(task)
            finally:
                await driver.abort()
                for task in self.running_groups:
                    task.cancel()
                await asyncio.gather(*self.running_groups, return_exceptions=True)
                runner.close()

    def samples_in_flight(self) -> int:
        return sum(len(group) for group in self.running_groups.values())

    def _start_trajectories(self, runner: TrajectoryRunner) -> None:
        while self.samples_in_flight() + self.group_size <= self.max_samples and not self.buffer.full:
            if self.to_continue:
                group = self.to_continue.popleft()
            else:
                group = self.manager.new_group(self._next_record(), self.version)
                with self._lock:
                    self._stats.submitted_groups += 1
            task = self.manager.start_custom_group(runner, group, f"v{self.version}.{self._segment}")
            self.running_groups[task] = group

    async def _collect(self, task: asyncio.Task) -> None:
        """A group whose trajectories returned: scored and kept, or (aborted) set aside to continue."""
        group = self.running_groups.pop(task)
        await task
        if any(s.status is Status.ABORTED for s in group):
            self.to_continue.append(group)
            return
        finished: list[list[Sample]] = []

        def finish() -> int:
            with self._lock:
                before = self._stats.filtered_groups
                self.manager.finish_group(group, finished, self._stats)
                return self._stats.filtered_groups - before

        filtered = await asyncio.to_thread(finish)
        for kept in finished:
            self._keep(kept)
        if filtered:
            self._check_filter(filtered)

    async def _serve_calls(self, driver: EngineDriver) -> None:
        while self._commands:
            fn, mode, future = self._commands.popleft()
            started = time.perf_counter()
            try:
                if mode != "in_place":
                    await self._retract(driver)
                result = await driver.on_engine_thread(lambda: self.stream.after_trainer(fn))
            except BaseException as error:  # handed to the caller; the backend may be broken: stop
                future.set_exception(error)
                raise
            else:
                future.set_result(result)
            finally:
                driver.accept_requests()
                self._add_idle(time.perf_counter() - started)

    async def _retract(self, driver: EngineDriver) -> None:
        """Abort the requests in flight and wait for every trajectory to return (its samples
        ``ABORTED`` with what they have); their groups continue afterwards."""
        await driver.abort()
        while self.running_groups:
            done, _ = await asyncio.wait(self.running_groups, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                await self._collect(task)
        self._segment += 1

    def _pause(self, mode: str, engine_alive: bool = True) -> Any:
        """Without a running event loop nothing is in flight: the trajectories ended with it."""
        return None
