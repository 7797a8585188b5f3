"""Custom generate functions of the agentic tests (loaded by ``--custom-generate-function-path``
as ``tests.agentic.trajectories.<name>``): two model turns around a slow tool call."""

from __future__ import annotations

import asyncio
import threading
import time

#: seconds a tool call takes
TOOL_S = 0.5
#: the tool's answer, appended between the turns (not trained)
TOOL_TOKENS = [7, 7, 7]


class Gauge:
    """How many trajectories run now, and the most at once."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running = self.peak = self.calls = 0

    def __enter__(self):
        with self.lock:
            self.calls += 1
            self.running += 1
            self.peak = max(self.peak, self.running)

    def __exit__(self, *exc):
        with self.lock:
            self.running -= 1


GAUGE = Gauge()


async def two_turns_async(args, sample, sampling_params, session):
    """Generate 2 tokens, a tool call of TOOL_S seconds, its output, 2 more tokens."""
    with GAUGE:
        first = await session.async_generate(sample.tokens, {**sampling_params, "max_new_tokens": 2})
        session.append_generation(sample, first)
        await asyncio.sleep(TOOL_S)
        session.append_tokens(sample, TOOL_TOKENS)
        second = await session.async_generate(sample.tokens, {**sampling_params, "max_new_tokens": 2})
        session.append_generation(sample, second)
        sample.metadata["turns"] = 2
    return sample


def two_turns_sync(args, sample, sampling_params, session):
    """:func:`two_turns_async` as a plain function (runs in a worker thread)."""
    with GAUGE:
        first = session.generate(sample.tokens, {**sampling_params, "max_new_tokens": 2})
        session.append_generation(sample, first)
        time.sleep(TOOL_S)
        session.append_tokens(sample, TOOL_TOKENS)
        second = session.generate(sample.tokens, {**sampling_params, "max_new_tokens": 2})
        session.append_generation(sample, second)
        sample.metadata["turns"] = 2
    return sample


async def fails_on_odd_groups(args, sample, sampling_params, session):
    """Raises for the samples of odd groups; one model turn otherwise."""
    if sample.group_index % 2:
        raise RuntimeError(f"tool crashed on group {sample.group_index}")
    output = await session.async_generate(sample.tokens, {**sampling_params, "max_new_tokens": 2})
    session.append_generation(sample, output)


async def long_on_later_groups(args, sample, sampling_params, session):
    """Groups 0 and 1 answer in 3 tokens, later ones in 40 (slow: aborted when the batch is full).
    A continued (ABORTED) sample asks only for the tokens it still lacks."""
    want = 3 if sample.group_index < 2 else 40
    sample.metadata.setdefault("calls", 0)
    sample.metadata["calls"] += 1
    output = await session.async_generate(sample.tokens, {**sampling_params,
                                                          "max_new_tokens": want - sample.response_length})
    session.append_generation(sample, output)


def blocking_generate_in_async(args, sample, sampling_params, session):
    """Wrong use: the blocking call inside a coroutine (returned by a plain function)."""

    async def run():
        session.generate(sample.tokens, sampling_params)

    return run()


SEEN_TOOLS: list = []


async def record_tools(args, sample, sampling_params, session):
    """Records the tools each trajectory got, then one model turn."""
    SEEN_TOOLS.append((sample.prompt, sample.metadata.get("tools"), list(sample.tokens)))
    output = await session.async_generate(sample.tokens, {**sampling_params, "max_new_tokens": 1})
    session.append_generation(sample, output)


def fails_fast_or_generates_long(args, sample, sampling_params, session):
    """Odd groups raise at once; even groups block in a long engine request (a plain function)."""
    if sample.group_index % 2:
        raise RuntimeError(f"tool crashed on group {sample.group_index}")
    output = session.generate(sample.tokens, {**sampling_params, "max_new_tokens": 10_000})
    session.append_generation(sample, output)
