"""Scoring samples: built-in (``--rm-type``), custom (``--custom-rm-path``) or
remote (``--rm-url``) rewards, per sample or per group (``--group-rm``).

A reward function that raises marks that sample FAILED with the reason in
``sample.metadata["failure"]``; the other samples are scored as usual and the
run carries on.

The samples of a group are scored at the same time (:func:`call_each`: one event loop
for an ``async def`` reward, daemon threads otherwise, at most
:data:`MAX_CONCURRENT_REWARDS` at once). In-process rewards (custom and built-in) are
given ``--rm-timeout`` seconds per call (per group with ``--group-rm``): one that
blocks fails its sample with a :class:`RewardTimeout` instead of hanging the run.
``sys.exit`` in reward code fails the sample too (:class:`RewardExited`). Python
cannot intercept ``os._exit``, which ends the whole process: reward code that may
call it has to run in a subprocess of its own (or behind ``--rm-url``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import numbers
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable

from miles_host.function_contracts import load_adapted
from miles_host.function_loading import load_function  # noqa: F401 - re-exported: the flags' loader
from miles_host.sample import Sample, Status


def _call(function: Callable, *args: Any) -> Any:
    result = function(*args)
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    return result


async def _await(awaitable):
    return await awaitable


class RewardTimeout(TimeoutError):
    """An in-process reward did not return within ``--rm-timeout`` seconds."""


class RewardExited(RuntimeError):
    """Reward code called ``sys.exit``."""


def call_with_timeout(function: Callable, args: tuple, timeout_s: float | None) -> Any:
    """``function(*args)`` (awaited when it is a coroutine) in a daemon thread of its own,
    given ``timeout_s`` seconds. A thread cannot be killed: one that times out is left
    blocked (a daemon, so it never holds up the exit). ``KeyboardInterrupt`` raised in
    the reward reaches the caller as it is."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    value, error = _finish(_start(function, args), deadline, timeout_s)
    if error is not None:
        raise error
    return value


#: at most this many rewards of one group are in flight at once (threads, or coroutines of one event loop)
MAX_CONCURRENT_REWARDS = 32


def _is_async(function: Callable) -> bool:
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(getattr(function, "__call__", None))


def call_each(function: Callable, args_list: list[tuple], timeout_s: float | None,
              limit: int = MAX_CONCURRENT_REWARDS) -> list[tuple[Any, BaseException | None]]:
    """``function(*args)`` for every ``args`` of ``args_list`` at the same time, at most ``limit``
    at once; ``(value, None)`` or ``(None, error)`` per call, in order. Each call gets
    ``timeout_s`` seconds (:class:`RewardTimeout`); ``sys.exit`` becomes :class:`RewardExited`.

    An ``async def`` reward runs as coroutines of one event loop (in a daemon thread); a
    plain function in daemon threads, ``limit`` at a time (a blocked one is left behind,
    as in :func:`call_with_timeout`)."""
    if not args_list:
        return []
    if _is_async(function):
        return _gather(function, args_list, timeout_s, limit)
    results: list[tuple[Any, BaseException | None]] = []
    for start in range(0, len(args_list), limit):
        window = [_start(function, args) for args in args_list[start : start + limit]]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        results.extend(_finish(call, deadline, timeout_s) for call in window)
    return results


def _start(function: Callable, args: tuple) -> tuple[dict, threading.Event]:
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            outcome["value"] = _call(function, *args)
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            outcome["error"] = error
        finally:
            done.set()

    threading.Thread(target=target, name=f"miles-reward-{getattr(function, '__name__', 'fn')}", daemon=True).start()
    return outcome, done


def _finish(call: tuple[dict, threading.Event], deadline: float | None, timeout_s: float | None):
    outcome, done = call
    if not done.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
        return None, RewardTimeout(f"no answer within --rm-timeout {timeout_s:g} s (the reward blocks?)")
    return outcome.get("value"), _as_reward_error(outcome.get("error"))


def _as_reward_error(error: BaseException | None, timeout_s: float | None = None) -> BaseException | None:
    if isinstance(error, SystemExit):
        exited = RewardExited(f"the reward code called sys.exit({error.code!r})")
        exited.__cause__ = error
        return exited
    if isinstance(error, asyncio.TimeoutError) and not isinstance(error, RewardTimeout):
        return RewardTimeout(f"no answer within --rm-timeout {timeout_s:g} s (the reward blocks?)")
    return error


def _gather(function: Callable, args_list: list[tuple], timeout_s: float | None, limit: int):
    """The coroutines of an ``async def`` reward, ``limit`` at once, on one event loop."""

    async def all_calls():
        semaphore = asyncio.Semaphore(limit)

        async def one(args):
            async with semaphore:
                return await asyncio.wait_for(function(*args), timeout_s)

        return await asyncio.gather(*(one(args) for args in args_list), return_exceptions=True)

    # a coroutine that blocks the loop (time.sleep inside async def) is caught by the overall deadline
    rounds = -(-len(args_list) // limit)
    overall = None if timeout_s is None else timeout_s * rounds + 1.0
    value, error = _finish(_start(lambda: asyncio.run(all_calls()), ()), None if overall is None
                           else time.monotonic() + overall, overall)
    if error is not None:
        return [(None, error)] * len(args_list)
    return [(None, _as_reward_error(r, timeout_s)) if isinstance(r, BaseException) else (r, None) for r in value]


def remote_reward(url: str, timeout: float, retries: int) -> Callable:
    """POST the sample as JSON to ``url``; the response is the reward (a number or
    a JSON object). Retries with backoff on network errors."""

    def reward(sample: Sample, config: Any = None) -> Any:
        payload = json.dumps(
            {"prompt": sample.prompt, "response": sample.response, "label": sample.label, "metadata": sample.metadata}
        ).encode()
        last_error: Exception | None = None
        for attempt in range(retries + 1):
            try:
                request = urllib.request.Request(url, data=payload, headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    return json.loads(response.read().decode())
            except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
                last_error = error
                time.sleep(min(0.5 * 2**attempt, 4.0))
        raise RuntimeError(f"remote reward {url} failed after {retries + 1} attempts: {last_error}")

    return reward


def _no_reward(*args: Any) -> Any:
    raise ValueError("no reward configured: set --rm-type, --custom-rm-path or --rm-url")


def _zero_reward(*args: Any) -> float:
    """The reward of ``--use-opd`` without a reward flag: 0 for every sample (upstream
    miles' pure-OPD reward post-process gives the same)."""
    return 0.0


class RewardScorer:
    """Resolves the configured reward once and scores groups of samples."""

    def __init__(self, config: Any, registry: Any):
        self.config = config
        self.group = bool(config.group_rm)
        self.busy_s = 0.0
        self.timeout_s: float | None = config.rm_timeout  # in-process rewards; --rm-url times its requests itself
        if config.custom_rm_path:
            self.function = load_adapted(config.custom_rm_path, "custom_rm_path", config)
            self.source = f"--custom-rm-path {config.custom_rm_path}"
        elif config.rm_url:
            self.function = remote_reward(config.rm_url, config.rm_timeout, config.rm_max_retries)
            self.timeout_s = None
            self.source = f"--rm-url {config.rm_url}"
        elif config.rm_type:
            self.source = f"--rm-type {config.rm_type}"
            record = registry.get(config.rm_type)
            self.function = record.fn
            self.group = self.group or record.group
        elif config.use_opd:  # on-policy distillation alone: the teacher's reverse KL is the only signal
            self.function = _zero_reward
            self.source = "--use-opd without a reward (0)"
        else:  # runs whose samples carry their rewards (loaded, SFT, a rollout function's); scoring is an error
            self.function = _no_reward
            self.source = "no reward"

    def call(self, samples: Any) -> Any:
        """The reward of one sample (a list of them with ``--group-rm``)."""
        if self.timeout_s is None:
            return _call(self.function, samples, self.config)
        return call_with_timeout(self.function, (samples, self.config), self.timeout_s)

    def call_each(self, samples: list[Sample]) -> list[tuple[Any, BaseException | None]]:
        """The rewards of several samples, scored concurrently (:func:`call_each`)."""
        return call_each(self.function, [(sample, self.config) for sample in samples], self.timeout_s)

    def scalar(self, reward: Any) -> float:
        """The number the advantages use (``--reward-key`` picks it from a dict).

        TypeError unless it is a real number (bool and numpy scalars included), ValueError
        when it is NaN or infinite: such a sample fails alone instead of poisoning the step."""
        value = reward
        if isinstance(reward, dict):
            key = self.config.reward_key or "score"
            if key not in reward:
                raise ValueError(f"reward dict {reward} has no key {key!r}; set --reward-key")
            value = reward[key]
        if not isinstance(value, numbers.Real):
            hint = " (return float(x) or x.item())" if hasattr(value, "item") else ""
            raise TypeError(
                f"a reward must be a number, or a dict holding one under --reward-key; got "
                f"{type(value).__name__} {_short(value)}{hint}"
            )
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(f"the reward is {number}; a reward must be a finite number")
        return number

    def score_group(self, samples: list[Sample]) -> None:
        """Set ``sample.reward`` for every sample of one prompt, in place (the time it takes
        adds to :attr:`busy_s`, the ``perf/reward_time_s`` of the step)."""
        start = time.perf_counter()
        try:
            self._score_group(samples)
        finally:
            self.busy_s += time.perf_counter() - start

    def pop_busy_time(self) -> float:
        """Seconds spent scoring since the last call."""
        busy, self.busy_s = self.busy_s, 0.0
        return busy

    def _score_group(self, samples: list[Sample]) -> None:
        if self.group:
            try:
                rewards = self.call(samples)
                if len(rewards) != len(samples):
                    raise ValueError(f"group reward returned {len(rewards)} rewards for {len(samples)} samples")
                for sample, reward in zip(samples, rewards):
                    sample.reward = reward
            except Exception as error:  # noqa: BLE001 - one failing group must not stop the run
                for sample in samples:
                    _fail(sample, error, self.source)
                return
            for sample in samples:
                try:
                    self.scalar(sample.reward)
                except (TypeError, ValueError) as error:  # one bad reward of the group fails its sample
                    _fail(sample, error, self.source)
            return
        # the group's samples are scored at the same time (an async or remote reward waits once, not n times)
        pending = [sample for sample in samples if sample.status is not Status.FAILED]
        for sample, (reward, error) in zip(pending, self.call_each(pending)):
            if error is None:
                try:
                    sample.reward = reward
                    self.scalar(reward)
                    continue
                except (TypeError, ValueError) as bad:  # not a finite number: this sample fails alone
                    error = bad
            if not isinstance(error, Exception):  # KeyboardInterrupt in reward code stops the run
                raise error
            _fail(sample, error, self.source)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fail(sample: Sample, error: Exception, source: str) -> None:
    sample.status = Status.FAILED
    sample.reward = None
    sample.metadata["failure"] = f"reward ({source}): {type(error).__name__}: {error}"
