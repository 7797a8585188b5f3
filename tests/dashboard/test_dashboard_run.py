"""A real ``miles run`` with ``--use-miles-dashboard``, wandb (offline), TensorBoard and the
profiler on the tiny task: the dashboard answers while the run runs, the sample files hold the
trainer's log-probs (checked against transformers), and the loggers' files hold metrics.jsonl."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from miles_host.dashboard.samples import step_file
from tests.dashboard.wandb_records import history_rows
from tests.loop.conftest import base_args, read_metrics, tiny_task  # noqa: F401 - tiny_task: the fixture

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def transformers_log_probs(model_dir: Path, sample: dict, prompt_ids: list[int]) -> list[float]:
    """The initial policy's log-probs of the sample's response tokens, from transformers (float64)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    ids = torch.tensor([prompt_ids + sample["tokens"]])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(ids).logits[0, :-1], dim=-1)
    targets = ids[0, 1:]
    picked = log_probs.gather(-1, targets[:, None])[:, 0]
    return picked[len(prompt_ids) - 1 :].tolist()


def test_run_serves_its_dashboard_and_writes_what_it_shows(tiny_task, tmp_path):
    model, data = tiny_task
    out, port = tmp_path / "run", free_port()
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text('{"input": "1+1=", "label": "2"}\n{"input": "2+3=", "label": "5"}\n')
    args = base_args(model, data, out, "--num-rollout", "3", "--use-miles-dashboard", "--miles-dashboard-port", str(port),
                     "--use-wandb", "--wandb-mode", "offline", "--use-tensorboard", "--eval-prompt-data", "tiny",
                     str(eval_file), "--eval-interval", "2", "--use-pytorch-profiler", "--profile-step-start", "1",
                     "--profile-step-end", "2", "--profile-target", "train_actor")
    process = subprocess.Popen([sys.executable, "-m", "miles_host.cli.main", *args], stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "WANDB_SILENT": "true"})
    seen_live = 0
    try:
        while process.poll() is None:  # the dashboard answers while the run runs, with the steps logged so far
            try:
                reply = get_json(f"http://127.0.0.1:{port}/api/runs/run/metrics?offset=0")
                if process.poll() is None:
                    seen_live = max(seen_live, len(reply["records"]))
            except OSError:
                pass
            time.sleep(0.2)
        stderr = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr
    assert f"dashboard at http://127.0.0.1:{port}/" in stderr
    assert seen_live >= 1
    metrics = read_metrics(out)
    steps = [m for m in metrics if m["rollout_id"] >= 0 and "perf/step_time_s" in m]
    assert all(m["perf/reward_time_s"] <= m["perf/rollout_time_s"] for m in steps)

    # the rollout browser's samples of step 0: the trainer's log-probs are the initial policy's
    samples = [json.loads(line) for line in step_file(out, 0).read_text().splitlines()]
    assert len(samples) == 16  # every sample of the step (4 prompts x 4) fits the default 32
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    for sample in samples[:3]:
        prompt_ids = tokenizer(sample["prompt"])["input_ids"]
        assert len(prompt_ids) == sample["prompt_length"]
        reference = transformers_log_probs(model, sample, prompt_ids)
        assert sample["train_log_probs"] == pytest.approx(reference, abs=2e-4)
        assert sample["rollout_log_probs"] == pytest.approx(reference, abs=2e-4)
        assert sample["token_text"] == [tokenizer.decode([token]) for token in sample["tokens"]]

    # wandb offline and TensorBoard hold metrics.jsonl's numbers
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    rows = {row["rollout_id"]: row for row in history_rows(run_dir)}
    for record in metrics:
        for key, value in record.items():
            if isinstance(value, (int, float)):
                assert rows[record["rollout_id"]][key] == pytest.approx(value, rel=1e-12), key
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for record in metrics:
        for key, value in record.items():
            if key != "rollout_id" and isinstance(value, (int, float)):
                stored = {e.step: e.value for e in events.Scalars(key)}
                assert stored[record["rollout_id"]] == pytest.approx(value, rel=1e-6, abs=1e-30), key
    assert [p.name.split(".")[0] for p in (out / "tensorboard").glob("*.pt.trace.json.gz")] == ["train_actor_step1"]
