"""``--use-pytorch-profiler`` traces per ``--profile-target`` and ``--record-memory-history``
snapshots (:mod:`miles_host.profiling`), over a loop shaped like the run's: each rollout step
calls the trainer (``train_actor``), whose log-prob pass (``train_log_probs``) runs inside it."""

from __future__ import annotations

import gzip
import json
import pickle
import re
from pathlib import Path

import pytest
import torch

from miles_host.config import MilesConfig
from miles_host.profiling import RunProfiler, region

STEPS = 4


def fake_run(profiler: RunProfiler) -> None:
    """Rollout steps with marked work: generation, the trainer call and its log-prob pass."""
    x = torch.randn(32, 32)
    for rollout_id in range(STEPS):
        profiler.begin_step(rollout_id)
        with torch.profiler.record_function(f"test:rollout{rollout_id}"):
            x = torch.tanh(x @ x)
        with region("train_actor"):
            with region("train_log_probs"):
                x = torch.tanh(x @ x)
            x = torch.tanh(x @ x)
        profiler.end_step(rollout_id)
    profiler.close()


def traces(folder: Path) -> dict[str, list[str]]:
    """Trace file name (its target and step) -> the names of its events."""
    out = {}
    for path in folder.glob("*.pt.trace.json.gz"):
        with gzip.open(path) as handle:
            events = json.load(handle)["traceEvents"]
        out[path.name.split(".")[0]] = [event.get("name", "") for event in events]
    return out


def config(tmp_path: Path, *targets: str, **flags) -> MilesConfig:
    return MilesConfig(output_dir=str(tmp_path), use_pytorch_profiler=True, profile_target=list(targets),
                       profile_step_start=1, profile_step_end=3, **flags)


def test_trainer_targets_trace_each_profiled_step(tmp_path):
    fake_run(RunProfiler(config(tmp_path, "train_actor", "train_log_probs"), tmp_path))
    found = traces(tmp_path)
    # steps [1, 3) only; the log-prob pass runs inside the trainer call: a range of its trace
    assert sorted(found) == ["train_actor_step1", "train_actor_step2"]
    for name in found:
        assert found[name].count("miles:train_actor") == 1 and found[name].count("miles:train_log_probs") == 1
        assert not any(n.startswith("test:rollout") for n in found[name])  # the trainer call alone


def test_train_overall_traces_whole_steps(tmp_path):
    fake_run(RunProfiler(config(tmp_path, "train_overall", "train_actor"), tmp_path))
    found = traces(tmp_path)
    assert list(found) == ["train_overall_step1"]
    names = found["train_overall_step1"]
    # Megatron's schedule: step 0 waits, so the recorded steps are 1 and 2, each one whole
    assert sorted(n for n in names if n.startswith("test:rollout")) == ["test:rollout1", "test:rollout2"]
    assert names.count("miles:train_actor") == 2
    assert "miles:train_log_probs" not in names  # not a target of this run


def test_profile_flags_are_checked():
    with pytest.raises(ValueError, match="0 <= start < end"):
        MilesConfig(use_pytorch_profiler=True, profile_step_start=3, profile_step_end=3)
    with pytest.raises(ValueError, match="--profile-target train_everything"):
        MilesConfig(profile_target=["train_everything"])
    with pytest.raises(ValueError, match="--memory-snapshot-num-steps"):
        MilesConfig(memory_snapshot_num_steps=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path: no CUDA memory history without CUDA")
def test_memory_history_without_cuda_warns(tmp_path):
    with pytest.warns(UserWarning, match="no CUDA device"):
        profiler = RunProfiler(MilesConfig(record_memory_history=True, memory_snapshot_dir=str(tmp_path)), tmp_path)
    fake_run(profiler)
    assert list(tmp_path.glob("memory_snapshot_*")) == []


@pytest.mark.gpu
def test_cuda_memory_snapshot_after_the_chosen_step(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("CUDA memory snapshots need a CUDA device")
    flags = dict(record_memory_history=True, memory_snapshot_dir=str(tmp_path / "snap"), memory_snapshot_num_steps=2)
    profiler = RunProfiler(MilesConfig(**flags), tmp_path)
    kept = []
    for rollout_id in range(STEPS):
        profiler.begin_step(rollout_id)
        kept.append(torch.empty(1 << 20, device="cuda"))  # 4 MiB a step
        profiler.end_step(rollout_id)
    profiler.close()
    (path,) = (tmp_path / "snap").glob("memory_snapshot_time*_rank0_snapshot.pickle")
    snapshot = pickle.loads(path.read_bytes())
    # dumped after step 1 (two steps): the first two 4 MiB blocks are in the trace, the later ones are not
    allocs = [e for trace in snapshot["device_traces"] for e in trace if e["action"] == "alloc" and e["size"] == 4 << 20]
    assert len(allocs) == 2
    assert re.match(r"memory_snapshot_time\d+_rank0_snapshot\.pickle", path.name)
