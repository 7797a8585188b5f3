"""OPD over two trainer processes (gloo: native_dp, or Megatron with PP 2 / TP 2) equals one process: the
teacher scores in the loop's process and the data-parallel trainers gather every
sample's old log-probs for the penalty."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import read_metrics, run_launched, run_one_process
from tests.opd.test_opd_run import opd_args


def test_two_trainers_and_a_rollout_process_match_one_process(opd_task, tmp_path):
    student, teacher, data = opd_task
    common = ("--num-rollout", "2", "--global-batch-size", "8")
    assert run_one_process(opd_args(student, teacher, data, tmp_path / "one", *common)) == 0
    assert run_launched(opd_args(student, teacher, data, tmp_path / "many", *common, "--weight-sync", "broadcast"),
                        worker_timeout=60, actor_num_gpus_per_node=2, rollout_num_gpus=1) == 0
    expected, got = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "many")
    assert len(got) == 2
    for want, have in zip(expected, got):
        for key in ("opd/kl", "opd/abs_log_prob_gap", "train/loss", "train/grad_norm"):
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("parallel", [pytest.param("--pipeline-model-parallel-size", marks=pytest.mark.slow),  # (CI time)
                                      "--tensor-model-parallel-size"])
def test_megatron_model_parallel_trainers_match_the_native_trainer(opd_task, tmp_path, parallel):
    """--train-backend megatron with PP 2 or TP 2 (two processes): the same OPD metrics and loss."""
    pytest.importorskip("miles_megatron")
    from miles_host.cli.main import main

    student, teacher, data = opd_task
    common = ("--num-rollout", "2", "--rollout-batch-size", "2", "--worker-timeout", "120")
    assert main(opd_args(student, teacher, data, tmp_path / "native", *common)) == 0
    assert main(opd_args(student, teacher, data, tmp_path / "megatron", *common, "--train-backend", "megatron",
                         parallel, "2", "--actor-num-gpus-per-node", "2")) == 0
    for want, have in zip(read_metrics(tmp_path / "native"), read_metrics(tmp_path / "megatron")):
        for key in ("opd/kl", "opd/teacher_log_prob", "train/loss"):
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
