"""``miles run --fully-async`` with the engine in its own process (``--rollout-num-gpus 1``
on CPU): the quickstart learns; every generated group is trained exactly once, across
weight updates, stale groups generated again and a resume; staleness stays within
``--max-weight-staleness``; ``--update-weights-interval 2`` pushes every second step; a
killed engine or trainer stops the run with a named error and a checkpoint."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from miles_host.cli.main import main
from miles_host.data import PromptDataset
from miles_host.checkpoint import load_checkpoint
from tests.distributed.conftest import base_args, read_metrics, run_launched
from tests.distributed.test_worker_failures import sync_faults  # noqa: F401 - fixture

ASYNC = ("--fully-async", "--rollout-num-gpus", "1", "--dump-rollouts")


def trained_samples(out: Path) -> list[tuple[int, dict]]:
    """(rollout id, sample) of every sample the run trained (``--dump-rollouts``)."""
    rows = []
    for path in sorted((out / "rollouts").glob("rollout_*.jsonl")):
        rollout_id = int(path.stem.split("_")[1])
        rows += [(rollout_id, json.loads(line)) for line in path.read_text().splitlines()]
    return rows


def staleness(rollout_id: int, sample: dict) -> int:
    versions = [v for v in sample["token_weight_versions"] if v is not None]
    assert len(sample["token_weight_versions"]) == sample["response_length"]
    return rollout_id - min(versions)


def test_the_quickstart_learns_fully_async_with_an_engine_process(tmp_path):
    out = tmp_path / "out"
    assert main(["run", *ASYNC, "--max-weight-staleness", "2", "--output-dir", str(out), "--no-progress"]) == 0
    rows = read_metrics(out)
    accuracy = [r["eval/addition/accuracy"] for r in rows if "eval/addition/accuracy" in r]
    assert accuracy[0] <= 0.40 and accuracy[-1] >= 0.80, accuracy
    samples = trained_samples(out)
    groups = Counter(s["group_index"] for _, s in samples)
    assert len(groups) == 30 * 16 and set(groups.values()) == {8}  # each group trained once, whole
    ages = Counter(staleness(r, s) for r, s in samples)
    assert max(ages) <= 2 and ages[1] > 0, ages  # generated while the previous step trained
    steps = [r for r in rows if r["rollout_id"] >= 0 and "rollout/fully_async/max_staleness" in r]
    assert all(r["rollout/fully_async/max_staleness"] <= 2 for r in steps) and len(steps) == 30


def test_every_prompt_is_trained_once_across_updates_stale_retries_and_a_resume(tiny_task, tmp_path):
    model, data = tiny_task
    flags = [*ASYNC, "--update-weights-interval", "2", "--max-weight-staleness", "1",
             "--async-unused-samples-handler", "retry", "--save", str(tmp_path / "ckpt")]
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(base_args(model, data, first, "--num-rollout", "3", *flags)) == 0
    assert main(base_args(model, data, second, "--num-rollout", "6", *flags, "--load", str(tmp_path / "ckpt"))) == 0

    # every step after a push trains with the pushed version; pushes after steps 1, 3 and the last
    versions = [r["rollout/weight_version"] for r in read_metrics(first) + read_metrics(second) if r["rollout_id"] >= 0]
    assert versions == [0, 2, 3, 4, 4, 6]
    samples = trained_samples(first) + trained_samples(second)
    assert sorted({r for r, _ in samples}) == list(range(6))
    assert max(staleness(r, s) for r, s in samples) <= 1
    groups = Counter(s["group_index"] for _, s in samples)
    assert set(groups.values()) == {4}, groups  # no group trained twice or in part
    prompts = Counter(s["metadata"]["prompt_index"] for _, s in samples)
    assert set(prompts.values()) == {4}  # no prompt trained twice (a stale group's prompt is generated again)
    # the 24 prompts trained are the first 24 of the data order: none lost, across the resume
    dataset = PromptDataset.from_file(str(data), "input", "label", "metadata", True, 42)
    assert set(prompts) == {record.index for record in dataset.next_batch(24)}


def test_a_killed_engine_stops_a_fully_async_run_with_a_checkpoint(tiny_task, tmp_path, fault_plugin, capsys):
    model, data = tiny_task
    argv = base_args(model, data, tmp_path / "o", *ASYNC, "--num-rollout", "4", "--save", str(tmp_path / "ckpt"),
                     *fault_plugin, "--test-rollout-die-after-syncs", "2")  # SIGKILL after the first push
    assert run_launched(argv, worker_timeout=15) == 3
    err = capsys.readouterr().err
    assert "worker rollout-0" in err and "killed by signal 9" in err, err
    # the trainer trains buffered groups while the engine dies: the last step whose training finished is
    # saved (the last logged one, or the next when only its weight push failed)
    last = max(r["rollout_id"] for r in read_metrics(tmp_path / "o"))
    state = load_checkpoint(str(tmp_path / "ckpt"))
    assert state["rollout_id"] in (last, last + 1) and "fully_async" in state["rollout"]
    assert f"checkpoint of rollout {state['rollout_id']} written" in err, err


def test_a_killed_trainer_stops_a_fully_async_run_with_a_checkpoint(tiny_task, tmp_path, sync_faults, capsys):  # noqa: F811
    model, data = tiny_task
    argv = base_args(model, data, tmp_path / "o", *ASYNC, "--num-rollout", "4", "--save", str(tmp_path / "ckpt"),
                     *sync_faults, "--test-trainer-die-at-train", "2")
    assert run_launched(argv, worker_timeout=15, actor_num_gpus_per_node=2) == 3
    err = capsys.readouterr().err
    assert "worker trainer-1" in err and "killed by signal 9" in err, err
    assert "checkpoint of rollout 0 written" in err, err
    state = load_checkpoint(str(tmp_path / "ckpt"))["rollout"]["fully_async"]
    # the batch of the step that failed is kept, untrained, for the resumed run
    assert len(state["finished"]) >= 4


def test_a_fully_async_run_over_ray_placed_workers(tiny_task, tmp_path):
    """Trainers and the engine as Ray actors: the producer drives the engine actor while the
    trainer actors train."""
    model, data = tiny_task
    out = tmp_path / "ray"
    argv = base_args(model, data, out, *ASYNC, "--num-rollout", "3", "--weight-sync", "broadcast", "--use-ray")
    assert run_launched(argv, worker_timeout=120, actor_num_gpus_per_node=2) == 0
    assert [r["rollout/weight_version"] for r in read_metrics(out)] == [1, 2, 3]
    groups = Counter(s["group_index"] for _, s in trained_samples(out))
    assert len(groups) == 12 and set(groups.values()) == {4}


def test_a_colocated_engine_process_generates_while_the_trainer_trains(tiny_task, tmp_path):
    """``--fully-async --colocate``: the engine process shares the trainer's device with both
    sides resident (no memory handed over between phases) and keeps generating during training."""
    model, data = tiny_task
    out = tmp_path / "colocated"
    argv = base_args(model, data, out, "--fully-async", "--colocate", "--rollout-backend", "process", "--dump-rollouts",
                     "--num-rollout", "3")
    assert main(argv) == 0
    rows = [r for r in read_metrics(out) if r["rollout_id"] >= 0]
    assert [r["rollout/weight_version"] for r in rows] == [1, 2, 3]
    assert not any("perf/phase_switch_time_s" in r for r in rows)  # nothing released or resumed
    samples = trained_samples(out)
    assert set(Counter(s["group_index"] for _, s in samples).values()) == {4}
    assert max(staleness(r, s) for r, s in samples) >= 1  # generated while an earlier step trained


def test_fully_async_refuses_the_offload_flags_and_plans_no_phases():
    from miles_host.cli.args import resolve_run_config
    from miles_host.phases import PhasePlan
    from miles_host.plugin_manager import MilesPluginManager

    for flag in ("--offload-rollout", "--offload-train"):
        with pytest.raises(ValueError, match=f"--fully-async with {flag}"):
            resolve_run_config(["--fully-async", "--colocate", flag], MilesPluginManager())
    config, _ = resolve_run_config(["--fully-async", "--colocate"], MilesPluginManager())
    assert not PhasePlan.from_config(config).active
