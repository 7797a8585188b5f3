"""miles run with a custom generate function: concurrent trajectories under --partial-rollout,
and evaluation generating with the same function."""

from __future__ import annotations

import json
import textwrap

from miles_host.cli.main import main
from tests.loop.conftest import base_args, read_metrics


def test_partial_rollout_and_eval_with_an_async_custom_generate_function(tiny_task, tmp_path, monkeypatch):
    (tmp_path / "agent_turns.py").write_text(textwrap.dedent(
        """
        import asyncio

        CALLS = []

        async def generate(args, sample, sampling_params, session):
            CALLS.append(sample.metadata.get("prompt_index", "eval"))
            first = await session.async_generate(sample.tokens, {**sampling_params, "max_new_tokens": 1})
            session.append_generation(sample, first)
            await asyncio.sleep(0.01)  # a tool call
            session.append_tokens(sample, session.tokenizer("=", add_special_tokens=False)["input_ids"])
            second = await session.async_generate(sample.tokens, {**sampling_params, "max_new_tokens": 2})
            session.append_generation(sample, second)
        """
    ))
    monkeypatch.syspath_prepend(str(tmp_path))
    model, data = tiny_task
    out = tmp_path / "out"
    assert main(base_args(model, data, out, "--num-rollout", "2", "--partial-rollout", "--over-sampling-batch-size", "6",
                          "--custom-generate-function-path", "agent_turns.generate", "--dump-rollouts",
                          "--eval-prompt-data", "addition", str(data), "--eval-interval", "1")) == 0
    rows = read_metrics(out)
    assert all(r["rollout/failed_samples"] == 0 for r in rows if "rollout/failed_samples" in r)
    assert all("eval/addition/accuracy" in r for r in rows)
    import agent_turns

    assert agent_turns.CALLS.count("eval") == 3 * 64  # 3 evaluations of the 64 prompts, by the custom function
    samples = [json.loads(line) for line in (out / "rollouts" / "rollout_00001.jsonl").read_text().splitlines()]
    for sample in samples:
        assert sample["loss_mask"][1] == 0 and sample["loss_mask"][0] == 1  # the tool token is not trained


def test_session_samples_train_with_the_engines_log_probs(tmp_path, monkeypatch):
    """An openai-client agent through --use-session-server: the trainer's log-probs of the recorded
    generated tokens equal the engine's (the tokens are exactly what was sampled)."""
    from tests.agentic.chat_fixtures import build_chat_model

    model = build_chat_model(tmp_path / "model")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+{i}=?", "label": str(2 * i)}) + "\n" for i in range(8)))
    (tmp_path / "length_reward.py").write_text("def reward(sample, config):\n    return float(sample.response_length)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    assert main(["run", "--hf-checkpoint", str(model), "--prompt-data", str(data), "--label-key", "label",
                 "--custom-rm-path", "length_reward.reward", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                 "--rollout-max-response-len", "6", "--num-rollout", "2", "--lr", "1e-3", "--device", "cpu",
                 "--custom-generate-function-path", "tests.agentic.agents.two_turns_with_tool_output",
                 "--use-session-server", "--output-dir", str(out), "--no-progress", "--dump-rollouts"]) == 0
    rows = read_metrics(out)
    assert all(r["rollout/failed_samples"] == 0 for r in rows)
    assert all(r["train/train_rollout_logprob_abs_diff_max"] < 1e-4 for r in rows)
    samples = [json.loads(line) for line in (out / "rollouts" / "rollout_00001.jsonl").read_text().splitlines()]
    assert all(s["metadata"]["session_turns"] == 2 and 0 in s["loss_mask"] for s in samples)
