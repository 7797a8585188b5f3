"""`miles run --rollout-backend sglang` against `miles serve` on loopback."""

from __future__ import annotations

import json

import numpy as np

from miles_host.cli.main import main
from miles_host.sample import Sample, Status
from tests.loop.conftest import base_args, read_metrics
from tests.plugins.sglang.conftest import http, serve


def test_two_step_run_through_the_sglang_backend(dense_model, addition_data, tmp_path):
    handle = serve(dense_model)
    try:
        out = tmp_path / "run"
        code = main([*base_args(dense_model, addition_data, out), "--num-rollout", "2",
                     "--rollout-backend", "sglang", "--sglang-url", handle.url])
        assert code == 0
        metrics = read_metrics(out)
        assert [m["rollout_id"] for m in metrics] == [0, 1]
        assert all(np.isfinite(m["rollout/reward_mean"]) for m in metrics)
        assert all(m["rollout/failed_samples"] == 0 for m in metrics)
        assert metrics[-1]["rollout/weight_version"] == 2
        assert http(handle.url, "/get_model_info")[1]["weight_version"] == "2"
        assert json.loads((out / "config.json").read_text())["weight_sync"] == "sglang_tensor"
    finally:
        handle.shutdown()


def _dumped(out):
    lines = (out / "rollouts" / "rollout_00000.jsonl").read_text().splitlines()
    return sorted((Sample.from_dict(json.loads(line)) for line in lines), key=lambda s: s.index)


def test_r3_routes_and_logprobs_round_trip_exactly(moe_model, addition_data, tmp_path):
    """The same RL step through the embedded engine and through a `miles serve` server
    process that the sglang backend starts itself (no --sglang-url): identical tokens,
    rollout logprobs and routed experts (batch-invariant kernels on both)."""
    flags = ["--num-rollout", "1", "--plugins", "r3", "--true-on-policy", "--dump-rollouts",
             "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4"]
    embedded = tmp_path / "embedded"
    assert main([*base_args(moe_model, addition_data, embedded), *flags]) == 0
    remote = tmp_path / "sglang"
    assert main([*base_args(moe_model, addition_data, remote), *flags,
                 "--rollout-backend", "sglang", "--sglang-server-command", "miles"]) == 0
    local_rows, remote_rows = _dumped(embedded), _dumped(remote)
    assert len(local_rows) == len(remote_rows) == 4
    for local, sent in zip(local_rows, remote_rows):
        assert sent.status is not Status.FAILED
        assert sent.tokens == local.tokens
        assert sent.rollout_log_probs == local.rollout_log_probs
        assert sent.rollout_routed_experts.shape == (len(sent.tokens) - 1, 2, 2)
        np.testing.assert_array_equal(sent.rollout_routed_experts, local.rollout_routed_experts)


def test_miles_serve_command_in_a_subprocess(dense_model):
    """`miles serve` as users start it: a real server process on a free loopback port."""
    import socket
    import subprocess
    import sys
    import time

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    process = subprocess.Popen(
        [sys.executable, "-m", "miles_host.cli.main", "serve", "--hf-checkpoint", str(dense_model),
         "--port", str(port), "--device", "cpu", "--dtype", "float32", "--kv-cache-tokens", "2048"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):  # bounded: up to ~60 s for the interpreter and the model
            if process.poll() is not None:
                raise AssertionError(process.stderr.read().decode())
            try:
                if http(url, "/health")[0] == 200:
                    break
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            time.sleep(0.2)
        else:
            raise AssertionError("miles serve did not become healthy within 60 s")
        status, result = http(url, "/generate", {"input_ids": [2, 3], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
        assert status == 200 and len(result["output_ids"]) == 2
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_distributed_weight_sync_to_a_server_process(dense_model, addition_data, tmp_path):
    """Weights broadcast over a gloo group that a `miles serve` process joins; the
    server's logprobs then equal the trainer's for the same tokens."""
    out = tmp_path / "run"
    code = main([*base_args(dense_model, addition_data, out), "--num-rollout", "2", "--rollout-backend", "sglang",
                 "--sglang-server-command", "miles", "--weight-sync", "sglang_distributed",
                 "--update-weight-buffer-size", "20000"])
    assert code == 0
    metrics = read_metrics(out)
    assert [m["rollout/weight_version"] for m in metrics] == [1, 2]
    # the server samples with the trainer's weights: recomputed logprobs agree to float32 rounding
    assert all(m["train/train_rollout_logprob_abs_diff"] < 1e-5 for m in metrics)


def test_a_fully_async_run_through_the_sglang_backend(dense_model, addition_data, tmp_path):
    """``--fully-async`` over HTTP: weight updates retract the requests in flight (abort, then
    continue with the tokens they have), so each token keeps the version that generated it."""
    handle = serve(dense_model)
    try:
        out = tmp_path / "run"
        code = main([*base_args(dense_model, addition_data, out), "--num-rollout", "4", "--fully-async",
                     "--max-weight-staleness", "2", "--dump-rollouts",
                     "--rollout-backend", "sglang", "--sglang-url", handle.url])
        assert code == 0
        metrics = read_metrics(out)
        assert [m["rollout_id"] for m in metrics] == [0, 1, 2, 3]
        assert [m["rollout/weight_version"] for m in metrics] == [1, 2, 3, 4]
        assert all(m["rollout/fully_async/max_staleness"] <= 2 for m in metrics)
        seen = []
        for rollout_id in range(4):
            lines = (out / "rollouts" / f"rollout_{rollout_id:05d}.jsonl").read_text().splitlines()
            for sample in (Sample.from_dict(json.loads(line)) for line in lines):
                assert len(sample.token_weight_versions) == sample.response_length
                assert rollout_id - sample.oldest_weight_version <= 2
                seen.append(sample.group_index)
        assert len(seen) == 64 and len(set(seen)) == 16  # 4 steps x 4 groups of 4 samples, each group once
        assert http(handle.url, "/get_model_info")[1]["weight_version"] == "4"
    finally:
        handle.shutdown()


def test_in_place_pauses_are_refused_for_a_backend_without_token_versions(dense_model, addition_data, tmp_path,
                                                                        capsys):
    handle = serve(dense_model)
    try:
        argv = [*base_args(dense_model, addition_data, tmp_path / "run"), "--num-rollout", "1", "--fully-async",
                "--pause-generation-mode", "in_place", "--rollout-backend", "sglang", "--sglang-url", handle.url]
        assert main(argv) == 2
        assert "does not say which weights generated each token" in capsys.readouterr().err
    finally:
        handle.shutdown()
