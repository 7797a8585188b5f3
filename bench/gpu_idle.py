"""Where the GPU waits for the host in a training phase.

One more step of a run with its training phase under torch's profiler (host stacks and CUDA
activity): the GPU's idle gaps (no kernel, copy or memset running), each charged to the
host code that launched the first GPU work after it, by its innermost frames outside
torch. A training phase whose GPU time is less than another's but whose wall time is more
spends the difference in these gaps; this says which Python caused them.

    python bench/megatron_train.py --models moe --idle-gaps   # both backends (on the GPU)
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import torch

#: gaps shorter than this are the launch queue's normal jitter, not the host falling behind
MIN_GAP_US = 5.0
#: the profiled phase's label (its range also shows on the GPU's timeline: not GPU work)
PHASE = "training_phase"


def _where(launch: Any, depth: int = 3) -> str:
    """The innermost ``depth`` frames outside torch's own files of the Python stack that made
    ``launch`` (a CUDA runtime call: its stack is its enclosing operator's); for work launched
    where there is no Python stack (autograd's backward thread), the outermost operator
    around it (``autograd::engine::evaluate_function: ...Backward0``)."""
    event, outermost = launch, None
    while event is not None and not event.stack:
        outermost = event
        event = event.cpu_parent
    frames = [f for f in (event.stack if event is not None else []) if "/torch/" not in f and not f.startswith("<built-in")]
    if frames:
        return " <- ".join(f.rsplit("/", 1)[-1] for f in frames[:depth])
    return f"(no python frame) {outermost.name}" if outermost is not None else "(no python frame)"


def kernel_totals(events: Any, top: int = 60) -> dict[str, tuple[int, float]]:
    """``{name: (launches, total us)}`` of a profile's GPU work, the ``top`` longest in total."""
    from torch.autograd import DeviceType

    totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.device_type == DeviceType.CUDA and e.name != PHASE:
            totals[e.name][0] += 1
            totals[e.name][1] += e.time_range.end - e.time_range.start
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:top]
    return {name: (count, us) for name, (count, us) in ranked}


def idle_gaps(events: Any, window: tuple[float, float] | None = None) -> tuple[float, float, collections.Counter]:
    """``(busy_us, idle_us, idle_us_by_launcher)`` of a profile's events (``trace.events()``)
    within ``window`` (microseconds; default: first to last GPU event)."""
    from torch.autograd import DeviceType

    cpu_by_id = {e.id: e for e in events if e.device_type == DeviceType.CPU}
    device = sorted((e for e in events if e.device_type == DeviceType.CUDA and e.name != PHASE),
                    key=lambda e: e.time_range.start)
    if not device:
        return 0.0, 0.0, collections.Counter()
    start, end = window or (device[0].time_range.start, max(e.time_range.end for e in device))
    by_launcher: collections.Counter = collections.Counter()
    busy = idle = 0.0
    covered_until = start
    for event in device:
        gap = event.time_range.start - covered_until
        if gap >= MIN_GAP_US:
            launcher = cpu_by_id.get(getattr(event, "linked_correlation_id", -1))
            by_launcher[_where(launcher)] += gap
            idle += gap
        if event.time_range.end > covered_until:
            busy += event.time_range.end - max(event.time_range.start, covered_until)
            covered_until = event.time_range.end
    tail = end - covered_until
    if tail >= MIN_GAP_US:
        by_launcher["(after the last GPU work)"] += tail
        idle += tail
    return busy, idle, by_launcher


def idle_gaps_step(run, rollout_id: int, top: int = 25, json_path: Path | None = None) -> dict:
    """One more step of ``run`` with its training phase profiled; prints the GPU's busy and
    idle time there, the ``top`` launchers of the work after the idle gaps and the longest
    kernels (all of it also to ``json_path``, to compare two runs' kernels)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    train = run.trainer.train
    result: dict = {}

    def profiled_train(samples):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as trace:
            with torch.profiler.record_function(PHASE):
                out = train(samples)
            torch.cuda.synchronize()
        events = trace.events()
        phase = next(e for e in events if e.name == PHASE and e.device_type != DeviceType.CUDA)
        busy, idle, by_launcher = idle_gaps(events, (phase.time_range.start, phase.time_range.end))
        wall = phase.time_range.end - phase.time_range.start
        print(f"training phase {wall / 1e3:.1f} ms: GPU busy {busy / 1e3:.1f} ms, idle {idle / 1e3:.1f} ms "
              f"in gaps >= {MIN_GAP_US:.0f} us (profiled: the host runs slower than unprofiled)")
        for where, gap in by_launcher.most_common(top):
            print(f"{gap / 1e3:9.2f} ms  {where}")
        kernels = kernel_totals(events)
        print(f"{'launches':>9} {'total ms':>9}  GPU work")
        for name, (count, us) in list(kernels.items())[:top]:
            print(f"{count:9d} {us / 1e3:9.2f}  {name[:110]}")
        result.update(wall_ms=wall / 1e3, busy_ms=busy / 1e3, idle_ms=idle / 1e3,
                      idle_ms_by_launcher={k: v / 1e3 for k, v in by_launcher.most_common(top)}, kernels=kernels)
        return out

    run.trainer.train = profiled_train
    try:
        run.step(rollout_id)
    finally:
        run.trainer.train = train
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=1))
    return result
