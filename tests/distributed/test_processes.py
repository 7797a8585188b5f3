"""Two trainer processes (gloo) + a rollout process against one process, on CPU."""

from __future__ import annotations

import time

import pytest
import torch

from miles_host.checkpoint import load_checkpoint
from miles_host.distributed.rollout_worker import packed_log_probs
from tests.distributed.conftest import base_args, read_metrics, resolve, run_launched, run_one_process

TWO_TRAINERS = dict(actor_num_gpus_per_node=2, rollout_num_gpus=1)


def _comparable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("perf/")}


def _model(directory) -> dict:
    return load_checkpoint(str(directory))["trainer"]["model"]


def test_two_trainers_and_a_rollout_process_match_one_process(tiny_task, tmp_path, signal_reward):
    """2 rollouts x 2 optimizer steps (--global-batch-size 8 of 16 samples): metrics
    and final weights of 2 gloo trainers + 1 engine process equal one process."""
    from miles_host.models import load_pretrained

    model, data = tiny_task
    common = ("--num-rollout", "2", "--global-batch-size", "8", *signal_reward)
    one = base_args(model, data, tmp_path / "one", *common, "--save", str(tmp_path / "c1"))
    many = base_args(model, data, tmp_path / "many", *common, "--save", str(tmp_path / "c2"), "--weight-sync", "broadcast")
    assert run_one_process(one) == 0
    assert run_launched(many, worker_timeout=60, **TWO_TRAINERS) == 0
    expected, got = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "many")
    assert [m["rollout_id"] for m in got] == [0, 1]
    for want, have in zip(expected, got):
        want, have = _comparable(want), _comparable(have)
        assert want.keys() == have.keys()
        for key in want:
            assert have[key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), key
    a, b = _model(tmp_path / "c1"), _model(tmp_path / "c2")
    start = load_pretrained(str(model), dtype=torch.float32, device="cpu").state_dict()
    assert any(not torch.equal(start[n], b[n]) for n in b)  # it trained
    # 4 Adam steps at lr 1e-3 move a weight by up to 4e-3; a lost or double-counted gradient
    # moves most weights by ~1e-3. The 2-rank all-reduce sums gradients in another order, and
    # where a gradient nearly cancels Adam scales that rounding up to the step size: a few
    # elements differ by up to ~1e-5 (8e-6 measured), the mean difference stays ~1e-9.
    total_diff = sum((a[n] - b[n]).abs().sum().item() for n in a)
    assert total_diff / sum(a[n].numel() for n in a) < 1e-7
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=5e-5), name


@pytest.mark.parametrize("transport", ["broadcast", "cuda_ipc", "disk"])
def test_rollout_process_logprobs_equal_trainer_after_each_sync(tiny_task, tmp_path, transport, signal_reward):
    from miles_host.distributed.launcher import make_run, stop_workers

    model, data = tiny_task
    argv = base_args(model, data, tmp_path / "o", "--num-rollout", "2", "--weight-sync", transport, *signal_reward)
    config, manager = resolve(argv, worker_timeout=60, **TWO_TRAINERS)
    run = make_run(config, manager)
    try:
        initial = {n: t.clone() for n, t in run.trainer.model.state_dict().items()}
        run.sync_weights(version=run.state.weight_version)
        for rollout_id in range(2):
            groups, _ = run.rollout.generate(rollout_id)
            samples = [s for g in groups for s in g]
            run.trainer.train(samples)
            run.sync_weights()
            for sample in samples[:3]:
                start = len(sample.tokens) - sample.response_length
                ids = torch.tensor(sample.tokens, dtype=torch.long)
                trainer_lp = packed_log_probs(run.trainer.model, ids, start)
                engine_lp = run.backend.log_probs(sample.tokens, start)
                assert engine_lp == pytest.approx(trainer_lp, abs=1e-6)
            assert run.backend.weight_version == rollout_id + 1
        assert any(not torch.equal(initial[n], t) for n, t in run.trainer.model.state_dict().items())
    finally:
        stop_workers(run)


def test_killing_the_rollout_process_stops_the_run_with_a_checkpoint(tiny_task, tmp_path, fault_plugin, capsys):
    model, data = tiny_task
    argv = base_args(model, data, tmp_path / "o", "--num-rollout", "3", "--save", str(tmp_path / "ckpt"),
                     *fault_plugin, "--test-rollout-die-after-syncs", "2")  # SIGKILL at the first step of rollout 1
    started = time.monotonic()
    assert run_launched(argv, worker_timeout=20, **TWO_TRAINERS) == 3
    assert time.monotonic() - started < 60
    err = capsys.readouterr().err
    assert "worker rollout-0" in err and "killed by signal 9" in err, err
    assert "checkpoint of rollout 0" in err, err
    state = load_checkpoint(str(tmp_path / "ckpt"))
    assert state["rollout_id"] == 0
    # usable: a one-process run resumes from it and finishes
    resume = base_args(model, data, tmp_path / "r", "--num-rollout", "2", "--load", str(tmp_path / "ckpt"))
    assert run_one_process(resume) == 0
    assert [m["rollout_id"] for m in read_metrics(tmp_path / "r")] == [1]


def test_a_hung_rollout_process_is_reported_after_the_timeout(tiny_task, tmp_path, fault_plugin, capsys):
    model, data = tiny_task
    argv = base_args(model, data, tmp_path / "o", "--num-rollout", "1",
                     *fault_plugin, "--test-rollout-hang-after-syncs", "1")  # hangs at its first step
    started = time.monotonic()
    assert run_launched(argv, worker_timeout=3, rollout_num_gpus=1) == 3
    assert time.monotonic() - started < 45
    err = capsys.readouterr().err
    assert "worker rollout-0" in err and "--worker-timeout 3" in err, err


@pytest.mark.slow  # CI time: Ray-placed workers run in test_fully_async_run, this layout as processes above
def test_two_trainers_and_a_rollout_as_ray_actors_match_one_process(tiny_task, tmp_path, signal_reward):
    """The same run with the workers placed by Ray (a local cluster, placement group)."""
    pytest.importorskip("ray")
    model, data = tiny_task
    common = ("--num-rollout", "2", "--global-batch-size", "8", *signal_reward)
    one = base_args(model, data, tmp_path / "one", *common)
    many = base_args(model, data, tmp_path / "ray", *common, "--weight-sync", "broadcast", "--use-ray")
    assert run_one_process(one) == 0
    assert run_launched(many, worker_timeout=120, **TWO_TRAINERS) == 0
    for want, have in zip(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "ray")):
        want, have = _comparable(want), _comparable(have)
        assert want.keys() == have.keys()
        for key in want:
            assert have[key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), key


@pytest.mark.parametrize("backend", ["native_dp", pytest.param("fsdp", marks=pytest.mark.slow)])  # fsdp: CI time
def test_resumed_multi_trainer_run_continues_like_an_uninterrupted_run(tiny_task, tmp_path, signal_reward, backend):
    """2 rollouts, then --load and 1 more, equal 3 rollouts in one run, with 2 trainer
    processes (regression: both ranks' optimizers once shared the loaded state's memory)."""
    model, data = tiny_task
    placement = dict(TWO_TRAINERS, train_backend=backend)
    common = ("--global-batch-size", "8", *signal_reward)
    straight = base_args(model, data, tmp_path / "straight", "--num-rollout", "3", *common)
    first = base_args(model, data, tmp_path / "first", "--num-rollout", "2", *common, "--save", str(tmp_path / "ck"))
    second = base_args(model, data, tmp_path / "second", "--num-rollout", "3", *common, "--load", str(tmp_path / "ck"))
    for argv in (straight, first, second):
        assert run_launched(argv, worker_timeout=90, **placement) == 0
    want, have = _comparable(read_metrics(tmp_path / "straight")[2]), _comparable(read_metrics(tmp_path / "second")[0])
    assert want.keys() == have.keys()
    for key in want:
        assert have[key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), key


def test_process_groups_meet_at_an_address_other_nodes_reach(monkeypatch):
    """One node: loopback. Several nodes: the driver's address (what Ray reports for this node)."""
    from types import SimpleNamespace

    from miles_host.distributed import launcher, ray_workers

    monkeypatch.setattr(ray_workers, "driver_address", lambda: "10.1.2.3")
    assert launcher.rendezvous_address(SimpleNamespace(actor_num_nodes=1)) == "127.0.0.1"
    assert launcher.rendezvous_address(SimpleNamespace(actor_num_nodes=2)) == "10.1.2.3"
