"""The calculator agent example (examples/agent_calculator): an openai-client agent trained
through rollout sessions learns to call the calculator with the right operator."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from miles_host.cli.main import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent_calculator"


@pytest.fixture
def example_modules():
    """The example's modules (``agent``, ``task``) are imported by their short names: forget them afterwards."""
    yield
    for name in ("agent", "task"):
        sys.modules.pop(name, None)


@pytest.mark.slow  # CI time: a learning run of the example agent
def test_the_example_agents_eval_accuracy_rises(tmp_path, monkeypatch, example_modules):
    monkeypatch.chdir(EXAMPLE)  # agent.generate, agent.reward and task are found from the current directory
    monkeypatch.syspath_prepend(str(EXAMPLE))
    from task import write_data

    train, evaluation = write_data(tmp_path)
    out = tmp_path / "out"
    code = main([
        "run", "--hf-checkpoint", str(EXAMPLE / "model"), "--prompt-data", str(train), "--input-key", "input",
        "--label-key", "label", "--tool-key", "tools",
        "--custom-generate-function-path", "agent.generate", "--use-session-server",
        "--session-prefix-mismatch", "retokenize", "--custom-rm-path", "agent.reward",
        "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "96",
        "--rollout-shuffle", "--num-rollout", "5", "--lr", "1e-3", "--micro-batch-size", "128",
        "--eval-prompt-data", "calculator", str(evaluation), "--eval-interval", "5", "--eval-temperature", "0",
        "--device", "cpu", "--dtype", "float32", "--output-dir", str(out), "--no-progress", "--dump-rollouts",
    ])
    assert code == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    accuracy = [row["eval/calculator/accuracy"] for row in rows if "eval/calculator/accuracy" in row]
    assert len(accuracy) == 2 and accuracy[-1] >= accuracy[0] + 0.3, accuracy
    rewards = [row["rollout/reward_mean"] for row in rows if "rollout/reward_mean" in row]
    assert rewards[-1] > rewards[0], rewards
    samples = [json.loads(line) for line in (out / "rollouts" / "rollout_00000.jsonl").read_text().splitlines()]
    called = [s for s in samples if s["metadata"].get("tool_calls")]
    assert len(called) > len(samples) // 2  # the base policy calls the tool
    for sample in called:  # the tool's answer sits in the sample and is not trained
        assert "<tool_response>" in sample["response"] and 0 in sample["loss_mask"] and 1 in sample["loss_mask"]
