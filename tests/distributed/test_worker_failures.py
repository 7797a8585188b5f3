"""Every worker failure around weight sync and training stops the run the same way:
exit 3, the worker that failed named, a checkpoint of the last completed rollout that
a one-process run resumes exactly."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from miles_host.checkpoint import load_checkpoint
from tests.distributed.conftest import base_args, read_metrics, run_launched, run_one_process

ONE_ENGINE = dict(rollout_num_gpus=1)
TWO_TRAINERS = dict(actor_num_gpus_per_node=2, rollout_num_gpus=1)


@pytest.fixture
def sync_faults(tmp_path, monkeypatch):
    """The ``sync_faults`` test plugin (tests/fault_plugin), installed as a distribution that
    the driver and the spawned workers discover."""
    info = tmp_path / "site" / "miles_test_sync_faults-0.0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: miles-test-sync-faults\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text("[miles.plugins]\nsync_faults = miles_test_sync_faults\n")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "fault_plugin"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return ["--plugins", "sync_faults"]


def _comparable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("perf/")}


def _fails_with_checkpoint_of(tmp_path, capsys, argv, placement, worker, how, rollout, timeout=30):
    started = time.monotonic()
    assert run_launched(argv, worker_timeout=timeout, **placement) == 3
    assert time.monotonic() - started < 150
    err = capsys.readouterr().err
    assert f"worker {worker}" in err and how in err, err
    assert f"checkpoint of rollout {rollout} written" in err, err
    assert load_checkpoint(str(tmp_path / "ckpt"))["rollout_id"] == rollout
    return err


def _resumes_like_an_uninterrupted_run(model, data, tmp_path, reward, resumed_rollouts):
    """One process: the straight run's metrics of the resumed rollouts equal the resumed run's."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_one_process(base_args(model, data, straight, "--num-rollout", "3", *reward)) == 0
    assert run_one_process(base_args(model, data, resumed, "--num-rollout", "3", *reward,
                                     "--load", str(tmp_path / "ckpt"))) == 0
    got = [_comparable(m) for m in read_metrics(resumed)]
    want = [_comparable(m) for m in read_metrics(straight)][-len(got):]
    assert [m["rollout_id"] for m in got] == resumed_rollouts
    for expected, have in zip(want, got):
        for key in expected:
            assert have[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key


def test_an_engine_killed_during_the_weight_broadcast(tiny_task, tmp_path, sync_faults, signal_reward, capsys):
    """The engine dies as the weights of rollout 0's update arrive: rollout 0 trained
    completely, so its checkpoint is written (with the data position after it)."""
    model, data = tiny_task
    argv = base_args(model, data, tmp_path / "o", "--num-rollout", "3", "--save", str(tmp_path / "ckpt"),
                     "--weight-sync", "broadcast", *signal_reward, *sync_faults, "--test-rollout-die-in-broadcast", "2")
    err = _fails_with_checkpoint_of(tmp_path, capsys, argv, ONE_ENGINE, "rollout-0", "killed by signal 9", 0)
    (line,) = [line for line in err.splitlines() if line.startswith("miles: error:")]
    assert line.startswith("miles: error: worker rollout-0"), line  # not a raw gloo traceback
    _resumes_like_an_uninterrupted_run(model, data, tmp_path, signal_reward, [1, 2])


@pytest.mark.slow  # CI time; a hung engine: tests/distributed/test_engine_restarts.py
def test_a_stopped_engine_during_the_weight_broadcast(tiny_task, tmp_path, sync_faults, signal_reward, capsys):
    model, data = tiny_task
    argv = base_args(model, data, tmp_path / "o", "--num-rollout", "3", "--save", str(tmp_path / "ckpt"),
                     "--weight-sync", "broadcast", *signal_reward, *sync_faults, "--test-rollout-stop-in-broadcast", "2")
    _fails_with_checkpoint_of(tmp_path, capsys, argv, ONE_ENGINE, "rollout-0", "did not answer", 0, timeout=15)


@pytest.mark.slow  # CI time; worker naming: test_a_trainer_killed_at_start_up_is_named
def test_a_stopped_trainer_1_is_named_trainer_1(tiny_task, tmp_path, sync_faults, signal_reward, capsys):
    """Trainer rank 1 stops at rollout 1's training: rank 0's all-reduce times out; the
    run names trainer-1 (not trainer-0), and rank 0 had not stepped, so rollout 0 is saved."""
    model, data = tiny_task
    argv = base_args(model, data, tmp_path / "o", "--num-rollout", "3", "--save", str(tmp_path / "ckpt"),
                     *signal_reward, *sync_faults, "--test-trainer-stop-at-train", "2")
    err = _fails_with_checkpoint_of(tmp_path, capsys, argv, TWO_TRAINERS, "trainer-1", "did not answer", 0, timeout=15)
    assert "worker trainer-0" not in err


def test_a_trainer_killed_in_training_leaves_the_last_completed_rollout(
        tiny_task, tmp_path, sync_faults, signal_reward, capsys):
    model, data = tiny_task
    argv = base_args(model, data, tmp_path / "o", "--num-rollout", "3", "--save", str(tmp_path / "ckpt"),
                     *signal_reward, *sync_faults, "--test-trainer-die-at-train", "2")
    _fails_with_checkpoint_of(tmp_path, capsys, argv, TWO_TRAINERS, "trainer-1", "killed by signal 9", 0)
    _resumes_like_an_uninterrupted_run(model, data, tmp_path, signal_reward, [1, 2])


@pytest.mark.slow  # (~20 s; the trainer killed in training is named by the same path in CI)
def test_a_trainer_killed_at_start_up_is_named(tiny_task, tmp_path, sync_faults, capsys):
    model, data = tiny_task
    argv = base_args(model, data, tmp_path / "o", "--num-rollout", "1", "--save", str(tmp_path / "ckpt"),
                     *sync_faults, "--test-trainer-die-at-start")
    started = time.monotonic()
    assert run_launched(argv, worker_timeout=15, **TWO_TRAINERS) == 3
    assert time.monotonic() - started < 120
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("miles: error:")]
    assert line.startswith("miles: error: worker trainer-1") and "killed by signal 9" in line, err
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").glob("iter_*"))
