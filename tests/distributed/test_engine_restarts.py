"""``--use-fault-tolerance``: rollout engine processes killed (SIGKILL) or stopped (SIGSTOP)
in the middle of a rollout are restarted with the current weights and their unfinished
requests generated again; the run ends like an uninterrupted one. Without it, or past
``--max-engine-restarts``, a failed engine stops the run (exit 3, a checkpoint)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import base_args, read_metrics, run_launched, run_one_process
from tests.distributed.test_worker_failures import sync_faults  # noqa: F401 - the fixture

TWO_ENGINES = dict(rollout_num_gpus=2)
#: a stopped engine is found within a few seconds
FAST_HEALTH_CHECK = ("--rollout-health-check-interval", "0.2", "--rollout-health-check-timeout", "2")


def _comparable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(("perf/", "ft/"))}


def _run_with_faults(tiny_task, tmp_path, plugin, reward, rollouts: int, *faults: str) -> list[dict]:
    """A one-process run and a fault-tolerant run with two engine processes and ``faults``:
    their metrics are equal, the restarts counted; the fault-tolerant run's stderr."""
    model, data = tiny_task
    common = ("--num-rollout", str(rollouts), *reward)
    assert run_one_process(base_args(model, data, tmp_path / "one", *common)) == 0
    argv = base_args(model, data, tmp_path / "ft", *common, "--use-fault-tolerance", *FAST_HEALTH_CHECK,
                     *plugin, *faults)
    assert run_launched(argv, worker_timeout=120, **TWO_ENGINES) == 0
    expected, got = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "ft")
    assert [m["rollout_id"] for m in got] == list(range(rollouts))
    for want, have in zip(expected, got):
        want, have = _comparable(want), _comparable(have)
        assert want.keys() == have.keys()
        for key in want:
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    return got


def test_a_killed_and_a_stopped_engine_are_restarted_and_the_run_matches_an_uninterrupted_one(
        tiny_task, tmp_path, fault_plugin, signal_reward, capsys):
    """Two engines get two requests (4 samples each) per rollout: in rollout 1, engine 0 is
    killed and engine 1 stopped once each has accepted its third request. Each sample has
    its own seed, so a resubmitted request generates the same tokens: every metric equals a
    one-process run's (the samples finish in another order)."""
    got = _run_with_faults(tiny_task, tmp_path, fault_plugin, signal_reward, 2,
                           "--test-engine-kill", "0:3", "--test-engine-stop", "1:3")
    assert [m["ft/engine_restarts"] for m in got] == [0, 2]
    err = capsys.readouterr().err
    assert "rollout engine rollout-0" in err and "killed by signal 9" in err, err
    assert "rollout engine rollout-1" in err and "sent no heartbeat" in err, err


@pytest.mark.slow
def test_engines_failing_in_different_rollouts_are_restarted(tiny_task, tmp_path, fault_plugin, signal_reward, capsys):
    """Engine 0 killed in rollout 1, engine 1 stopped in rollout 2."""
    got = _run_with_faults(tiny_task, tmp_path, fault_plugin, signal_reward, 3,
                           "--test-engine-kill", "0:3", "--test-engine-stop", "1:5")
    assert [m["ft/engine_restarts"] for m in got] == [0, 1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("fault_tolerance", [(), ("--use-fault-tolerance", "--max-engine-restarts", "0")],
                         ids=["off", "no-restarts-left"])
def test_a_killed_engine_stops_the_run_with_a_checkpoint(tiny_task, tmp_path, fault_plugin, capsys, fault_tolerance):
    """Without fault tolerance, or with no restart left, the run stops as it always did."""
    model, data = tiny_task
    argv = base_args(model, data, tmp_path / "o", "--num-rollout", "3", "--save", str(tmp_path / "ckpt"),
                     *fault_tolerance, *fault_plugin, "--test-engine-kill", "0:3")
    assert run_launched(argv, worker_timeout=120, **TWO_ENGINES) == 3
    err = capsys.readouterr().err
    assert "worker rollout-0" in err and "killed by signal 9" in err, err
    assert "checkpoint of rollout 0 written" in err, err
    assert "restarting" not in err
    if fault_tolerance:
        assert "restarted 0 time(s) already (--max-engine-restarts 0)" in err, err


@pytest.mark.slow
def test_a_dead_trainer_stops_a_fault_tolerant_run(tiny_task, tmp_path, sync_faults, signal_reward, capsys):
    """Fault tolerance restarts engines only: trainer rank 1 killed in training stops the run
    with its name and the checkpoint of the last completed rollout."""
    model, data = tiny_task
    argv = base_args(model, data, tmp_path / "o", "--num-rollout", "3", "--save", str(tmp_path / "ckpt"),
                     "--use-fault-tolerance", *signal_reward, *sync_faults, "--test-trainer-die-at-train", "2")
    assert run_launched(argv, worker_timeout=120, actor_num_gpus_per_node=2, rollout_num_gpus=1) == 3
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("miles: error:")]
    assert line.startswith("miles: error: worker trainer-1") and "killed by signal 9" in line, err
    assert "checkpoint of rollout 0 written" in err, err


@pytest.mark.slow
def test_engines_killed_in_the_weight_broadcast_are_restarted(tiny_task, tmp_path, sync_faults, signal_reward, capsys):
    """Both engines die as rollout 0's weights arrive: they are restarted, the restore
    completes the push, and the run matches an uninterrupted one."""
    got = _run_with_faults(tiny_task, tmp_path, sync_faults, signal_reward, 2, "--weight-sync", "broadcast",
                           "--test-rollout-die-in-broadcast", "2")
    assert [m["ft/engine_restarts"] for m in got] == [0, 2]
    assert "killed by signal 9" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_killed_engine_on_a_gpu_is_restarted_on_its_gpu(tiny_task, tmp_path, fault_plugin, signal_reward, capsys):
    """One trainer and one colocated engine on cuda:0 (weights by CUDA IPC): the engine is
    killed in rollout 1, started again on the same GPU and the run finishes with the
    rollouts of a run without the kill."""
    model, data = tiny_task
    common = ("--num-rollout", "2", "--device", "cuda", "--colocate", "--use-fault-tolerance", *FAST_HEALTH_CHECK,
              *signal_reward, *fault_plugin)
    assert run_launched(base_args(model, data, tmp_path / "plain", *common), worker_timeout=300, rollout_num_gpus=1) == 0
    argv = base_args(model, data, tmp_path / "ft", *common, "--test-engine-kill", "0:5")
    assert run_launched(argv, worker_timeout=300, rollout_num_gpus=1) == 0
    assert "rollout engine rollout-0" in capsys.readouterr().err
    plain, got = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "ft")
    assert [m["ft/engine_restarts"] for m in got] == [0, 1]
    assert [_comparable(m).keys() for m in got] == [_comparable(m).keys() for m in plain]
    for want, have in zip(plain, got):  # GPU kernels differ with the batch: response lengths, not bits
        assert have["rollout/response_len_mean"] == pytest.approx(want["rollout/response_len_mean"], abs=0.5)
