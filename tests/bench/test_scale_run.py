"""``bench/scale_run.py --tiny``: the scale run's plumbing on CPU (Megatron EP 2 over gloo,
an engine process, broadcast weight sync, FP8 + R3), and its MFU arithmetic."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("megatron.core", reason="megatron-core is not installed")


def test_active_parameters_of_the_qwen3_30b_a3b_shape():
    from bench.scale_run import active_params, model_shape

    # 48 layers x (q, k, v, o of 32 / 4 heads of 128 over hidden 2048 + router over 128 experts
    # + 8 experts x 3 x 2048 x 768) + the LM head: ~3.0B multiplied per token
    per_layer = 2048 * 128 * (32 + 4 + 4 + 32) + 2048 * 128 + 8 * 3 * 2048 * 768
    assert active_params(model_shape(False, None), 151936) == 48 * per_layer + 151936 * 2048


@pytest.mark.slow
def test_tiny_scale_run_with_fp8_and_r3(tmp_path):
    from bench import scale_run

    results = scale_run.main(["--tiny", "--variants", "fp8_r3", "--workdir", str(tmp_path)])
    run = results["fp8_r3"]
    assert run["steps"] == 2 and run["train_tok_per_s"] > 0 and run["weight_sync_s"] > 0
    assert run["r3_expert_agreement"] == 1.0
    assert run["train_rollout_logprob_abs_diff"] < 1e-5


def test_tiny_scale_run_on_one_device(tmp_path):
    """``--gpus 1``: the megatron trainer and the embedded engine in one process (the one-H200 version)."""
    from bench import scale_run

    results = scale_run.main(["--tiny", "--gpus", "1", "--variants", "fp8_r3", "--workdir", str(tmp_path)])
    run = results["fp8_r3"]
    assert run["steps"] == 2 and run["train_tok_per_s"] > 0
    assert run["r3_expert_agreement"] == 1.0
    assert run["train_rollout_logprob_abs_diff"] < 1e-5
