"""FSDP2 (``--train-backend fsdp``): two sharded trainer processes (gloo) against one process, on CPU."""

from __future__ import annotations

import pytest
import torch

from miles_host.checkpoint import load_checkpoint
from tests.distributed.conftest import base_args, read_metrics, run_launched, run_one_process

TWO_FSDP_TRAINERS = dict(actor_num_gpus_per_node=2, rollout_num_gpus=1, train_backend="fsdp")


def _comparable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("perf/")}


def _assert_same_metrics(expected: list[dict], got: list[dict]) -> None:
    assert [m["rollout_id"] for m in got] == [m["rollout_id"] for m in expected]
    for want, have in zip(expected, got):
        want, have = _comparable(want), _comparable(have)
        assert want.keys() == have.keys()
        for key in want:
            assert have[key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), key


@pytest.fixture
def reward_failing_three(tmp_path, monkeypatch):
    """A reward with variance in each group that fails the last 3 of each rollout's 16 samples."""
    import sys
    import textwrap

    (tmp_path / "fsdp_rewards.py").write_text(textwrap.dedent(
        """
        def odd_first_char_13_of_16(sample, config):
            if sample.index % 16 >= 13:
                raise RuntimeError("not scored")
            return float(sample.response[:1] in ("1", "3", "5", "7", "9", "+"))
        """
    ))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("fsdp_rewards", None)
    return ["--custom-rm-path", "fsdp_rewards.odd_first_char_13_of_16"]


def test_two_fsdp_trainers_match_one_process(tiny_task, tmp_path, reward_failing_three):
    """2 rollouts x 4 optimizer steps of 4, 4, 4 and 1 samples (13 of 16 samples scored; a rank
    with no sample only joins the collectives; micro-batches of 1 leave the ranks unequal):
    metrics, checkpoint weights and --save-hf weights of 2 FSDP2 trainers equal one process."""
    from miles_host.models import load_pretrained

    model, data = tiny_task
    common = ("--num-rollout", "2", "--global-batch-size", "4", "--micro-batch-size", "1", *reward_failing_three)
    one = base_args(model, data, tmp_path / "one", *common, "--save", str(tmp_path / "c1"))
    many = base_args(
        model, data, tmp_path / "fsdp", *common, "--save", str(tmp_path / "c2"),
        "--save-hf", str(tmp_path / "hf_{rollout_id}"), "--weight-sync", "broadcast",
    )
    assert run_one_process(one) == 0
    assert run_launched(many, worker_timeout=90, **TWO_FSDP_TRAINERS) == 0
    _assert_same_metrics(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "fsdp"))
    assert [m["rollout/failed_samples"] for m in read_metrics(tmp_path / "fsdp")] == [3, 3]  # steps of 4, 4, 4, 1
    a = load_checkpoint(str(tmp_path / "c1"))["trainer"]
    b = load_checkpoint(str(tmp_path / "c2"))["trainer"]
    start = load_pretrained(str(model), dtype=torch.float32, device="cpu").state_dict()
    assert any(not torch.equal(start[n], b["model"][n]) for n in b["model"])  # it trained
    # FSDP sums the gradient norm over shards and reduce-scatters per layer: fp32 sums in
    # another order, which Adam's normalisation amplifies where a gradient is ~0 (seen:
    # 2.5e-6 after 8 steps at lr 1e-3, a quarter of a percent of one step)
    for name in a["model"]:
        difference = (a["model"][name] - b["model"][name]).abs().max()
        assert difference <= 1e-5, (name, difference)
    # the gathered optimizer state is the one-process state (same keys, same moments)
    moments = lambda state: [v for s in state["optimizer"]["state"].values() for k, v in sorted(s.items()) if k != "step"]  # noqa: E731
    assert len(moments(a)) == len(moments(b))
    exported = load_pretrained(str(tmp_path / "hf_1"), dtype=torch.float32, device="cpu").state_dict()
    for name, tensor in exported.items():
        assert torch.allclose(tensor, b["model"][name], rtol=0, atol=0), name
