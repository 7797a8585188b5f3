"""Trainers in worker processes send each sample's training log-probs back to the driver, so
the train-data dump (and the dashboard, which reads the same metadata) has them for every sample."""

from __future__ import annotations

import json

import pytest
import torch

from miles_host.dashboard.samples import step_file
from miles_host.distributed.sample_details import put_details, take_details
from miles_host.sample import Sample
from tests.distributed.conftest import base_args, run_launched


def reference_response_log_probs(reference, tokens: list[int], length: int) -> torch.Tensor:
    """A transformers model's float64 log-softmax of ``tokens``' last ``length`` tokens (the independent reference)."""
    with torch.no_grad():
        logits = reference(torch.tensor([tokens])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0][-length:]


def assert_dump_has_initial_model_log_probs(dump, model_dir) -> None:
    """Step 0's train data holds, for every sample, the initial model's log-probs of its response."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    data = torch.load(dump / "train_data" / "0_0.pt", weights_only=True)["rollout_data"]
    assert data["log_probs"] and all(lp is not None for lp in data["log_probs"])
    for tokens, length, log_probs in zip(data["tokens"], data["response_lengths"], data["log_probs"]):
        assert len(log_probs) == length
        want = reference_response_log_probs(reference, tokens, length)
        torch.testing.assert_close(torch.tensor(log_probs, dtype=torch.float64), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", ["native_dp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_two_trainer_processes_dump_every_samples_log_probs(tiny_task, tmp_path, signal_reward, backend):
    """DP2 (gloo, two trainer processes): each rank trains on half of the samples; the driver's
    train-data dump has the log-probs of all of them, equal to transformers' float64 reference,
    and so has the dashboard's sample file."""
    model, data = tiny_task
    dump, out = tmp_path / "dump", tmp_path / "out"
    argv = [arg for arg in base_args(model, data, out, "--num-rollout", "1", "--dump-details", str(dump),
                                     "--use-miles-dashboard", *signal_reward) if arg not in ("--rm-type", "exact")]
    assert run_launched(argv, worker_timeout=60, actor_num_gpus_per_node=2, train_backend=backend) == 0
    assert_dump_has_initial_model_log_probs(dump, model)
    train_data = torch.load(dump / "train_data" / "0_0.pt", weights_only=True)["rollout_data"]
    want = dict(zip(train_data["sample_indices"], train_data["log_probs"]))
    shown = [json.loads(line) for line in step_file(out, 0).read_text().splitlines()]
    assert shown and all(record["train_log_probs"] == pytest.approx(want[record["index"]], abs=1e-8)
                         for record in shown)


def test_details_go_back_by_position_and_the_first_answer_stays():
    """take_details empties the worker's copies; put_details fills the driver's samples by position,
    keeping a value a sample already has (the driver's own rank, or an earlier tensor-parallel peer)."""
    worker = [Sample(index=i, prompt="p", tokens=[1, 2], response_length=1) for i in range(3)]
    worker[1].metadata["train_log_probs"] = [-0.5]
    worker[2].metadata.update(train_log_probs=[-0.25], routed_expert_agreement=[1.0], other="kept")
    details = take_details(worker)
    assert details == {1: {"train_log_probs": [-0.5]},
                       2: {"train_log_probs": [-0.25], "routed_expert_agreement": [1.0]}}
    assert worker[2].metadata == {"other": "kept"} and "train_log_probs" not in worker[1].metadata
    driver = [Sample(index=i, prompt="p", tokens=[1, 2], response_length=1) for i in range(3)]
    driver[2].metadata["train_log_probs"] = [-0.125]
    put_details(driver, [details, {1: {"train_log_probs": [-9.0]}}, None])
    assert [s.metadata.get("train_log_probs") for s in driver] == [None, [-0.5], [-0.125]]
    assert driver[2].metadata["routed_expert_agreement"] == [1.0]
