"""``--colocate``, ``--offload-train``, ``--offload-rollout``: the phases take turns on shared
devices (engines release their memory while training, trainers offload while rolling out)
and the run computes what it computes without them; placement errors are clear."""

from __future__ import annotations

import pytest
import torch

from miles_host.checkpoint import load_checkpoint
from tests.distributed.conftest import base_args, read_metrics, resolve, run_launched, run_one_process

COMMON = ("--num-rollout", "2", "--global-batch-size", "8")


def _assert_same_metrics(expected: list[dict], got: list[dict]) -> None:
    assert [m["rollout_id"] for m in got] == [m["rollout_id"] for m in expected]
    for want, have in zip(expected, got):
        assert "perf/phase_switch_time_s" in have
        want = {k: v for k, v in want.items() if not k.startswith("perf/")}
        have = {k: v for k, v in have.items() if not k.startswith("perf/")}
        assert want.keys() == have.keys()
        for key in want:
            assert have[key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), key
    assert any(m.get("train/loss") for m in got)  # the signal reward makes it train


@pytest.mark.slow  # CI time; colocated phases: test_colocated_phases_release_and_offload_every_worker
def test_two_colocated_trainers_and_engines_match_the_disaggregated_run(tiny_task, tmp_path, signal_reward):
    """2 gloo trainers + 2 engine processes, 2 rollouts: colocated (engines release their KV
    cache while training), also with --offload-train, and FSDP2 offloading both sides give
    the metrics of the disaggregated run; the offloaded FSDP2 run writes its checkpoint
    from CPU shards."""
    model, data = tiny_task
    placement = dict(actor_num_gpus_per_node=2, worker_timeout=90)
    apart = base_args(model, data, tmp_path / "apart", *COMMON, *signal_reward, "--save", str(tmp_path / "c1"))
    assert run_launched(apart, rollout_num_gpus=2, train_backend="native_dp", **placement) == 0
    expected = read_metrics(tmp_path / "apart")
    variants = {
        "colocate": ("native_dp", "--colocate"),
        "offload_train": ("native_dp", "--colocate", "--offload-train"),
        "fsdp_offload": ("fsdp", "--colocate", "--offload-train", "--offload-rollout"),
    }
    for name, (backend, *flags) in variants.items():
        argv = base_args(model, data, tmp_path / name, *COMMON, *signal_reward, *flags, "--save", str(tmp_path / name / "ck"))
        assert run_launched(argv, train_backend=backend, **placement) == 0, name
        _assert_same_metrics(expected, read_metrics(tmp_path / name))
    a = load_checkpoint(str(tmp_path / "c1"))["trainer"]["model"]
    b = load_checkpoint(str(tmp_path / "fsdp_offload" / "ck"))["trainer"]["model"]
    for name in a:  # FSDP2 sums in another order (see test_fsdp)
        assert (a[name] - b[name]).abs().max() <= 1e-5, name


def test_colocated_phases_release_and_offload_every_worker(tiny_task, tmp_path):
    """Between the phases each engine holds the tags it released and trainer rank 0 its
    state on CPU; the ranks' parameters get new storage each way."""
    from miles_host.distributed.launcher import make_run, stop_workers

    model, data = tiny_task
    argv = base_args(model, data, tmp_path / "o", "--num-rollout", "1", "--colocate", "--offload-train", "--offload-rollout")
    config, manager = resolve(argv, worker_timeout=60, actor_num_gpus_per_node=2)
    run = make_run(config, manager)
    try:
        assert len(run.backend.clients) == 2 and config.weight_sync == "broadcast"  # CPU: no CUDA IPC
        local = run.trainer.local
        trained = [p.data_ptr() for p in local.model.parameters()]
        run.phases.to_rollout(lambda: run.sync_weights(version=run.state.weight_version))
        assert local.train_state_offloaded
        offloaded = [p.data_ptr() for p in local.model.parameters()]
        assert all(a != b for a, b in zip(trained, offloaded))
        assert run.backend.resume_memory_occupation() == [[], []]
        groups, _ = run.rollout.generate(0)
        run.phases.to_train()
        assert run.backend.release_memory_occupation(["kv_cache"]) == [["kv_cache", "weights"]] * 2  # already released
        assert not local.train_state_offloaded
        run.trainer.train([s for g in groups for s in g])
        run.phases.to_rollout(run.sync_weights)
        assert run.backend.weight_version == 1 and local.train_state_offloaded
        assert run.backend.resume_memory_occupation() == [[], []]
    finally:
        stop_workers(run)


def test_one_process_colocated_and_offloaded_run_matches_the_plain_run(tiny_task, tmp_path, signal_reward, monkeypatch):
    """The embedded engine and the native trainer in one process: releasing the engine's
    KV cache and weights while training and offloading the trainer while rolling out
    change no metric."""
    from miles_host import offload
    from miles_host.rollout.engine import Engine

    calls: list[str] = []
    for name in ("offload_train_state", "onload_train_state"):
        original = getattr(offload, name)
        monkeypatch.setattr(offload, name, lambda trainer, _f=original, _n=name: (calls.append(_n), _f(trainer))[1])
    release = Engine.release_memory_occupation

    def spy(self, tags=None):
        calls.append("release " + ",".join(sorted(tags)))
        return release(self, tags)

    monkeypatch.setattr(Engine, "release_memory_occupation", spy)
    model, data = tiny_task
    assert run_one_process(base_args(model, data, tmp_path / "plain", *COMMON, *signal_reward)) == 0
    assert calls == []
    flags = ("--colocate", "--offload-train", "--offload-rollout")
    assert run_one_process(base_args(model, data, tmp_path / "colocated", *COMMON, *signal_reward, *flags)) == 0
    _assert_same_metrics(read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "colocated"))
    step = ["release kv_cache,weights", "onload_train_state", "offload_train_state"]
    assert calls == ["offload_train_state", *step, *step]


# -- placement --------------------------------------------------------------------------


def _placement(tiny_task, tmp_path, *flags, **fields):
    from miles_host.distributed.placement import check_placement

    model, data = tiny_task
    config, _ = resolve(base_args(model, data, tmp_path / "o", *flags), **fields)
    check_placement(config)
    return config


@pytest.mark.parametrize("trainers, engines", [(2, 3), (4, 3), (1, 2)])
def test_colocate_with_engines_that_cannot_share_the_trainer_gpus_evenly_is_a_clear_error(
    tiny_task, tmp_path, trainers, engines
):
    with pytest.raises(ValueError, match=rf"--rollout-num-gpus {engines} cannot share the {trainers} trainer GPU"):
        _placement(tiny_task, tmp_path, "--colocate", actor_num_gpus_per_node=trainers, rollout_num_gpus=engines)


def test_colocated_engines_default_to_one_per_trainer_and_spread_evenly(tiny_task, tmp_path):
    from miles_host.distributed.launcher import engine_gpu, num_engines

    config = _placement(tiny_task, tmp_path, "--colocate", actor_num_gpus_per_node=4)
    assert num_engines(config) == 4 and [engine_gpu(config, i) for i in range(4)] == [0, 1, 2, 3]
    config = _placement(tiny_task, tmp_path, "--colocate", actor_num_gpus_per_node=4, rollout_num_gpus=2)
    assert num_engines(config) == 2 and [engine_gpu(config, i) for i in range(2)] == [0, 2]
    config = _placement(tiny_task, tmp_path, actor_num_gpus_per_node=2, rollout_num_gpus=2)
    assert [engine_gpu(config, i) for i in range(2)] == [2, 3]  # disaggregated: after the trainers'
    with pytest.raises(ValueError, match="--use-ray"):
        _placement(tiny_task, tmp_path, "--colocate", "--use-ray", actor_num_gpus_per_node=2)


def test_gpu_checks_count_shared_gpus_once_and_default_to_cuda_ipc(tiny_task, tmp_path, monkeypatch):
    """With (pretended) 2 GPUs: 2 colocated trainers + 2 engines fit, disaggregated they do
    not; colocated weights go by CUDA IPC (NCCL broadcast cannot reach a process on one's own GPU)."""
    from miles_host.distributed.launcher import prepare
    from miles_host.plugin_manager import load_registries

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    config = _placement(tiny_task, tmp_path, "--colocate", device="cuda", actor_num_gpus_per_node=2)
    prepare(config, load_registries())
    assert config.weight_sync == "cuda_ipc" and config.rollout_backend == "process"
    with pytest.raises(ValueError, match=r"2 trainer\(s\) \+ 2 engine\(s\) need 4 GPUs, this node has 2"):
        _placement(tiny_task, tmp_path, device="cuda", actor_num_gpus_per_node=2, rollout_num_gpus=2)
    with pytest.raises(ValueError, match="sharing their GPUs with 4 engine.*need 4 GPUs"):
        _placement(tiny_task, tmp_path, "--colocate", device="cuda", actor_num_gpus_per_node=4)
    with pytest.raises(ValueError, match="NCCL cannot broadcast between two processes on one GPU"):
        _placement(tiny_task, tmp_path, "--colocate", "--weight-sync", "broadcast", device="cuda", actor_num_gpus_per_node=2)


@pytest.mark.parametrize("flags", [
    ("--device", "cpu", "--train-backend", "fsdp", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
     "--rollout-backend", "process", "--weight-sync", "broadcast"),
    ("--device", "cpu", "--train-backend", "fsdp", "--actor-num-gpus-per-node", "2", "--colocate",
     "--rollout-backend", "process", "--offload-train", "--offload-rollout"),
])
def test_the_gpu_suite_commands_parse(flags, capsys):
    """bench/gpu_suite.sh two_gpu: the quickstart preset with the placement flags resolves."""
    from miles_host.cli.main import main

    assert main(["run", *flags, "--num-rollout", "1", "--dry-run"]) == 0
    assert '"colocate"' in capsys.readouterr().out
