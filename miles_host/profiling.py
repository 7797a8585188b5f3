"""Torch profiler traces (``--use-pytorch-profiler``) and CUDA memory snapshots
(``--record-memory-history``) of a run, as upstream miles' ``TrainProfiler`` takes them.

- ``--profile-target train_overall``: one profiler over the run's rollout steps, recording steps
  ``[--profile-step-start, --profile-step-end)`` (Megatron's schedule: wait, one warm-up step,
  then the active steps) in one trace;
- ``train_actor`` / ``train_log_probs``: each trainer call (``Trainer.train``), or each of its
  log-prob passes without gradient, inside those steps gets a trace of its own
  (:func:`region`, armed per step by :meth:`RunProfiler.begin_step`); inside an enclosing
  target's trace they are named ranges (``miles:train_actor``) of it.

Traces are TensorBoard's trace files (``<target>_step<N>.<time>.pt.trace.json.gz``, readable by
TensorBoard's profiler plugin, Perfetto and chrome://tracing) under the TensorBoard directory.
Everything is taken in this process: a trainer in worker processes shows as waiting.

The memory history is recorded from the run's start and dumped (``torch.cuda.memory._dump_snapshot``)
after ``--memory-snapshot-num-steps`` rollout steps, at the end of the run when that is not
given, and when CUDA runs out of memory; without CUDA it is skipped with a warning.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

#: trainer targets armed for the step under way (empty outside the profiled steps):
#: target -> (trace directory, rollout id, whether it gets a trace of its own)
_ARMED: dict[str, tuple[Path, int, bool]] = {}
#: targets whose profiler is recording now (a profiler inside another one crashes kineto)
_RECORDING: list[str] = []


def _trace_handler(trace_dir: Path, worker_name: str):
    return torch.profiler.tensorboard_trace_handler(str(trace_dir), worker_name=worker_name, use_gzip=True)


def _new_profiler(**kwargs: Any) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True, **kwargs)


@contextlib.contextmanager
def region(target: str) -> Iterator[None]:
    """Trace the enclosed work when ``target`` is armed for this step (a no-op otherwise).
    Inside another target's trace (``train_log_probs`` within ``train_actor``, either within
    ``train_overall``) the work is a range named ``miles:<target>`` of that trace instead:
    torch profilers do not nest."""
    armed = _ARMED.get(target)
    if armed is None:
        yield
        return
    trace_dir, rollout_id, own_trace = armed
    if not own_trace or _RECORDING:
        with torch.profiler.record_function(f"miles:{target}"):
            yield
        return
    _RECORDING.append(target)
    try:
        with _new_profiler(on_trace_ready=_trace_handler(trace_dir, f"{target}_step{rollout_id}")):
            with torch.profiler.record_function(f"miles:{target}"):
                yield
    finally:
        _RECORDING.pop()


class RunProfiler:
    """The run's profilers; :meth:`begin_step` / :meth:`end_step` around each rollout step,
    :meth:`close` at the run's end."""

    def __init__(self, config: Any, trace_dir: Path, first_step: int = 0):
        self.config = config
        self.trace_dir = Path(trace_dir)
        self.targets = set(config.profile_target) if config.use_pytorch_profiler else set()
        self.overall: torch.profiler.profile | None = None
        if "train_overall" in self.targets:
            start, end = config.profile_step_start, config.profile_step_end
            first = max(start, first_step)  # a resumed run records the window's steps it still runs
            if first < end:
                self.overall = _new_profiler(
                    schedule=torch.profiler.schedule(wait=max(first - first_step - 1, 0),
                                                     warmup=1 if first > first_step else 0,
                                                     active=end - first, repeat=1),
                    on_trace_ready=_trace_handler(self.trace_dir, f"train_overall_step{first}"))
                self.overall.start()
        self.memory_path: Path | None = None
        if config.record_memory_history:
            self._start_memory_history()

    # -- torch profiler ----------------------------------------------------------

    def begin_step(self, rollout_id: int) -> None:
        """Arm the trainer targets when ``rollout_id`` is a profiled step."""
        _ARMED.clear()
        if self.config.profile_step_start <= rollout_id < self.config.profile_step_end:
            for target in self.targets - {"train_overall"}:
                _ARMED[target] = (self.trace_dir, rollout_id, self.overall is None)

    def end_step(self, rollout_id: int) -> None:
        """One rollout step done: the overall profiler steps; the memory snapshot is dumped when due."""
        _ARMED.clear()
        if self.overall is not None:
            self.overall.step()
        steps = self.config.memory_snapshot_num_steps
        if self.memory_path is not None and steps is not None and rollout_id == steps - 1:
            self._dump_memory(stop=True)

    def close(self) -> None:
        """Write what is still open: the overall trace, the memory snapshot of a run without
        ``--memory-snapshot-num-steps``."""
        _ARMED.clear()
        if self.overall is not None:
            self.overall.stop()
            self.overall = None
        if self.memory_path is not None:
            self._dump_memory(stop=True)

    # -- CUDA memory history ---------------------------------------------------------

    def _start_memory_history(self) -> None:
        if not torch.cuda.is_available():
            warnings.warn("--record-memory-history records CUDA allocations, and no CUDA device is available: "
                          "no memory snapshot is written")
            return
        folder = Path(self.config.memory_snapshot_dir)
        folder.mkdir(parents=True, exist_ok=True)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.memory_path = folder / f"memory_snapshot_time{time.time():.0f}_rank{rank}_{self.config.memory_snapshot_path}"
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="all")

        def on_out_of_memory(device, alloc, device_alloc, device_free):  # torch's observer signature
            print(f"miles: CUDA out of memory: memory snapshot written to {self.memory_path}", file=sys.stderr)
            torch.cuda.memory._dump_snapshot(os.fspath(self.memory_path))

        torch._C._cuda_attach_out_of_memory_observer(on_out_of_memory)

    def _dump_memory(self, stop: bool) -> None:
        path = self.memory_path
        torch.cuda.memory._dump_snapshot(os.fspath(path))
        print(f"miles: CUDA memory snapshot written to {path}", file=sys.stderr)
        if stop:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.memory_path = None
