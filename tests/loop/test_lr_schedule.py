"""The learning-rate schedule spans the run's optimizer steps, however they are counted
(``--num-epoch`` or ``--num-rollout``, ``--global-batch-size`` or ``--num-steps-per-rollout``)."""

from __future__ import annotations

import json
import math

import pytest

from miles_host.cli.main import main
from miles_host.config import MilesConfig
from miles_host.lr_schedule import lr_lambda, step_sizes, total_optimizer_steps
from miles_host.trainer import NativeTrainer
from tests.loop.conftest import base_args, read_metrics, write_addition_data


@pytest.mark.parametrize("flags,num_samples,sizes", [
    ({}, 16, [16]),
    ({"global_batch_size": 8}, 16, [8, 8]),
    ({"global_batch_size": 5}, 16, [5, 5, 5, 1]),
    ({"num_steps_per_rollout": 3}, 16, [6, 5, 5]),
    ({"num_steps_per_rollout": 6}, 10, [2, 2, 2, 2, 1, 1]),
    ({"num_steps_per_rollout": 4}, 3, [1, 1, 1]),
    ({"global_batch_size": 4, "num_steps_per_rollout": 2}, 16, [4, 4, 4, 4]),  # the batch size decides
    ({}, 0, []),
])
def test_step_sizes(flags, num_samples, sizes):
    assert step_sizes(num_samples, MilesConfig(**flags)) == sizes


def test_total_optimizer_steps():
    config = MilesConfig(rollout_batch_size=8, n_samples_per_prompt=8, global_batch_size=8)
    assert total_optimizer_steps(config, 100) == 800  # not 100: 8 steps per rollout


def test_decay_without_a_length_is_refused():
    with pytest.raises(ValueError, match="--lr-decay-iters"):
        lr_lambda(MilesConfig(lr_decay_style="cosine"))
    assert lr_lambda(MilesConfig())(10**6) == 1.0  # constant needs no length


def test_factors_follow_megatron_formulas():
    """Warm-up inside the decay steps, as Megatron counts them."""
    config = MilesConfig(lr=1.0, min_lr=0.1, lr_decay_style="cosine", lr_warmup_iters=2, lr_decay_iters=10)
    factor = lr_lambda(config)
    assert [factor(0), factor(1)] == [0.5, 1.0]
    for step in range(2, 12):
        progress = min(1.0, (step - 2) / 8)
        assert factor(step) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)), abs=1e-15)


@pytest.fixture
def optimizer_steps(monkeypatch):
    """Counts the optimizer steps the trainers take (NaN-skipped steps included, none happen here)."""
    counter = {"steps": 0}
    original = NativeTrainer._clip_and_step

    def counting(self, out, loss_sum):
        counter["steps"] += 1
        return original(self, out, loss_sum)

    monkeypatch.setattr(NativeTrainer, "_clip_and_step", counting)
    return counter


@pytest.mark.parametrize("name,flags,steps_per_rollout", [
    ("one epoch of 8 prompts", ("--num-epoch", "1"), 1),
    ("global batch below the rollout", ("--num-rollout", "2", "--global-batch-size", "4"), 4),
    ("steps per rollout", ("--num-rollout", "2", "--num-steps-per-rollout", "3"), 3),
    ("megatron trainer", ("--num-epoch", "1", "--global-batch-size", "8", "--train-backend", "megatron"), 2),
])
def test_linear_decay_spans_exactly_the_steps_taken(tiny_task, tmp_path, optimizer_steps, name, flags, steps_per_rollout):
    """``train/lr`` is the learning rate of each rollout's last optimizer step. Linear decay to 0
    over ``T`` steps gives step ``s`` the rate ``lr * (1 - s / T)``: the logged rates give back
    ``T``, which must be the number of steps the run took (and the last rate is above 0)."""
    if "megatron" in flags:
        pytest.importorskip("miles_megatron")
    model, _ = tiny_task
    data = write_addition_data(tmp_path / "eight.jsonl", 8)  # rollout batch 4 x 4 samples: 2 rollouts per epoch
    out = tmp_path / "out"
    assert main(base_args(model, data, out, *flags, "--lr-decay-style", "linear", "--min-lr", "0")) == 0
    rows = [r for r in read_metrics(out) if r.get("rollout_id", -1) >= 0]
    assert len(rows) == 2 and optimizer_steps["steps"] == 2 * steps_per_rollout
    taken = optimizer_steps["steps"]
    for rollout, row in enumerate(rows):
        last_step = (rollout + 1) * steps_per_rollout - 1
        assert row["train/lr"] == pytest.approx(1e-3 * (1 - last_step / taken), rel=1e-9)
    assert rows[-1]["train/lr"] > 0


def test_cosine_lr_above_zero_at_the_last_step_of_an_epoch_run(tiny_task, tmp_path):
    model, _ = tiny_task
    data = write_addition_data(tmp_path / "eight.jsonl", 8)
    out = tmp_path / "out"
    args = base_args(model, data, out, "--num-epoch", "1", "--global-batch-size", "8", "--lr-decay-style", "cosine")
    assert main(args) == 0
    rows = read_metrics(out)
    # 2 rollouts x 2 steps: the last step is step 3 of 4, cos(pi * 3/4) gives 0.146 of the rate
    assert rows[-1]["train/lr"] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 3 / 4)), rel=1e-9)


def test_config_json_records_the_resolved_schedule_length(tiny_task, tmp_path):
    model, _ = tiny_task
    data = write_addition_data(tmp_path / "eight.jsonl", 8)
    out = tmp_path / "out"
    assert main(base_args(model, data, out, "--num-epoch", "1", "--global-batch-size", "8",
                          "--lr-decay-style", "cosine")) == 0
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["lr_decay_iters"] == 4  # 2 rollouts x 2 optimizer steps
