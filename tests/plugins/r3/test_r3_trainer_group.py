"""miles-r3 with two trainer processes: the dashboard shows, for every sample, the per-token
routed-expert agreement and training log-probs that the trainer rank which trained it computed."""

from __future__ import annotations

import json

import pytest

from miles_host.dashboard.samples import step_file
from tests.distributed.conftest import run_launched, run_one_process
from tests.plugins.r3.test_r3 import save_moe_task


@pytest.fixture(scope="module")
def qwen3_moe_task(tmp_path_factory):
    return save_moe_task(tmp_path_factory.mktemp("r3_group"), "qwen3_moe", prompts=16)


def _argv(model, data, out) -> list[str]:
    return ["run", "--hf-checkpoint", str(model), "--prompt-data", str(data), "--label-key", "label",
            "--custom-rm-path", "tests.plugins.r3.test_r3.length_reward", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6", "--num-rollout", "1",
            "--micro-batch-size", "1", "--lr", "1e-3", "--dtype", "bfloat16", "--device", "cpu", "--no-progress",
            "--plugins", "r3", "--use-miles-dashboard", "--output-dir", str(out)]


def _shown(out) -> dict[int, dict]:
    return {record["index"]: record for record in map(json.loads, step_file(out, 0).read_text().splitlines())}


@pytest.mark.slow
def test_two_trainer_processes_show_every_samples_agreement_as_one_process_does(qwen3_moe_task, tmp_path):
    """DP2 (gloo): each sample's per-token agreement and training log-probs in the dashboard's
    sample file equal a one-process run's (the same rollout, micro-batches of one sample)."""
    model, data = qwen3_moe_task
    assert run_one_process(_argv(model, data, tmp_path / "one")) == 0
    assert run_launched(_argv(model, data, tmp_path / "two"), worker_timeout=90, actor_num_gpus_per_node=2) == 0
    one, two = _shown(tmp_path / "one"), _shown(tmp_path / "two")
    assert one.keys() == two.keys() and len(two) == 16
    for index, record in two.items():
        want = one[index]
        assert record["tokens"] == want["tokens"]
        agreement = record["routed_expert_agreement"]
        assert agreement is not None and len(agreement) == len(record["tokens"])
        assert agreement == want["routed_expert_agreement"], index
        assert record["train_log_probs"] == pytest.approx(want["train_log_probs"], abs=1e-5), index
    shares = [value for record in two.values() for value in record["routed_expert_agreement"]]
    assert all(0.0 <= value <= 1.0 for value in shares) and min(shares) < 1.0  # the routers disagree somewhere
