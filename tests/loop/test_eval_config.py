"""--eval-config: two data sets with their own keys, samples, sampling settings and rewards;
--log-passrate's pass@k against the unbiased estimator 1 - C(n-c, k)/C(n, k)."""

from __future__ import annotations

import json
from math import comb

import pytest

from miles_host.builtin.rewards import miles_register_reward_functions
from miles_host.cli.main import main
from miles_host.config import MilesConfig, validate_config
from miles_host.evaluation import load_eval_datasets, run_evals
from miles_host.reward import RewardScorer
from tests.loop.conftest import base_args, read_metrics


class Registry:
    def __init__(self):
        self.records = {record.name: record for record in miles_register_reward_functions()}

    def get(self, name):
        return self.records[name]


class AnsweringBackend:
    """Answers request ``<tag>-<rollout>-<index>-<k>`` with ``answer(tag, index, k)``; keeps each
    request's sampling params."""

    def __init__(self, answer):
        self.answer, self.pending, self.params = answer, [], {}

    def submit(self, rid, input_ids, sampling_params, return_routed_experts=False):
        self.pending.append(rid)
        self.params[rid] = sampling_params

    def has_unfinished(self):
        return bool(self.pending)

    def step(self):
        done, self.pending = self.pending, []
        outputs = []
        for rid in done:
            tag, index, k = rid.rsplit("-", 3)[0], int(rid.rsplit("-", 2)[1]), int(rid.rsplit("-", 1)[1])
            outputs.append({"meta_info": {"id": rid}, "text": self.answer(tag, index, k)})
        return outputs


class Rollout:
    def __init__(self, config, backend):
        self.config, self.backend = config, backend
        self.scorer = RewardScorer(config, Registry())

    def prompt_ids(self, prompt, tools=None):
        return [1, 2]

    def sampling_params(self, max_new_tokens, seed, eval_mode=False):
        return {"max_new_tokens": max_new_tokens, "temperature": 9.0, "top_p": 9.0, "top_k": 9}

    def apply_output(self, sample, output):
        sample.response = output["text"]


def correct_count(index, n):
    """How many of prompt ``index``'s n samples answer right (0..n, varied)."""
    return (index * 3) % (n + 1)


@pytest.fixture
def two_datasets(tmp_path):
    addition = tmp_path / "addition.jsonl"
    addition.write_text("".join(json.dumps({"input": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(5)))
    boxed = tmp_path / "boxed.jsonl"
    boxed.write_text("".join(json.dumps({"question": f"{i}*2?", "answer": str(2 * i)}) + "\n" for i in range(4)))
    config_file = tmp_path / "eval.yaml"
    config_file.write_text(f"""
eval:
  defaults:
    max_response_len: 6
  datasets:
    - name: addition
      path: {addition}
      n_samples_per_eval_prompt: 4
      temperature: 0.7
    - name: boxed
      path: {boxed}
      rm_type: math
      input_key: question
      label_key: answer
      n_samples_per_eval_prompt: 8
      top_p: 0.5
      top_k: 3
      max_response_len: 12
      stop: ["?"]
""")
    return config_file


def test_two_datasets_have_their_own_settings_metrics_and_pass_at_k(two_datasets):
    config = MilesConfig(label_key="label", rm_type="exact", eval_config=str(two_datasets), log_passrate=True,
                         eval_top_p=0.9, rollout_max_response_len=4)
    validate_config(config)
    assert config.eval_prompt_data[::2] == ["addition", "boxed"]
    n = {"addition": 4, "boxed": 8}
    labels = {"addition": lambda i: str(i + 1), "boxed": lambda i: str(2 * i)}

    def answer(tag, index, k):
        name = tag.removeprefix("eval-")
        right = labels[name](index)
        text = right if k < correct_count(index, n[name]) else "wrong"
        return rf"so \boxed{{{text}}}" if name == "boxed" else text

    backend = AnsweringBackend(answer)
    metrics = run_evals(config, Rollout(config, backend), 0, load_eval_datasets(config))

    params = {name: [p for rid, p in backend.params.items() if rid.startswith(f"eval-{name}-")] for name in n}
    assert len(params["addition"]) == 5 * 4 and len(params["boxed"]) == 4 * 8
    assert {(p["temperature"], p["top_p"], p["top_k"], p["max_new_tokens"]) for p in params["addition"]} == {(0.7, 0.9, -1, 6)}
    assert {(p["temperature"], p["top_p"], p["top_k"], p["max_new_tokens"]) for p in params["boxed"]} == {(1.0, 0.5, 3, 12)}
    assert all(p["stop"] == ["?"] for p in params["boxed"]) and not any("stop" in p for p in params["addition"])

    for name, prompts in (("addition", 5), ("boxed", 4)):
        counts = [correct_count(i, n[name]) for i in range(prompts)]
        assert metrics[f"eval/{name}/accuracy"] == pytest.approx(sum(counts) / (prompts * n[name]))
        ks = [k for k in (1, 2, 4, 8) if k <= n[name]]
        assert sorted(key for key in metrics if key.startswith(f"eval/{name}/pass@")) == sorted(f"eval/{name}/pass@{k}" for k in ks)
        for k in ks:
            expected = sum(1 - comb(n[name] - c, k) / comb(n[name], k) for c in counts) / prompts
            assert metrics[f"eval/{name}/pass@{k}"] == pytest.approx(expected, abs=1e-12)


def test_bad_eval_configs_are_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    for text, message in (("eval: {datasets: []}", "no data sets"),
                          ("eval: {datasets: [{name: a}]}", "needs path"),
                          ("eval: {datasets: [{name: a, path: p, tempurature: 1}]}", "unknown key.*tempurature"),
                          ("eval: {datasets: [{name: a, path: p, rm_type: nope}]}", "rm_type 'nope'"),
                          ("eval: {defaults: {min_new_tokens: 2}, datasets: [{name: a, path: p}]}", "min_new_tokens.*not supported")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            validate_config(MilesConfig(eval_config=str(bad)))
    with pytest.raises(ValueError, match="cannot read"):
        validate_config(MilesConfig(eval_config=str(tmp_path / "missing.yaml")))


def test_a_run_logs_each_dataset_and_pass_at_k(tiny_task, tmp_path):
    model, data = tiny_task
    held_out = tmp_path / "held.jsonl"
    held_out.write_text("".join(json.dumps({"q": f"{i}+{i}=", "a": str(2 * i)}) + "\n" for i in range(3)))
    config_file = tmp_path / "eval.yaml"
    config_file.write_text(json.dumps({"eval": {"datasets": {
        "train_like": {"path": str(data), "n_samples_per_eval_prompt": 2},
        "held": {"path": str(held_out), "input_key": "q", "label_key": "a", "n_samples_per_eval_prompt": 4,
                 "rm_type": "f1"},
    }}}))
    out = tmp_path / "out"
    assert main(base_args(model, data, out, "--num-rollout", "1", "--eval-config", str(config_file),
                          "--eval-interval", "1", "--log-passrate")) == 0
    evals = [m for m in read_metrics(out) if "eval/held/accuracy" in m]
    assert evals
    for metrics in evals:
        assert {"eval/train_like/pass@1", "eval/train_like/pass@2", "eval/held/pass@4"} <= set(metrics)
        # with 0/1 rewards pass@1 is the accuracy
        assert metrics["eval/train_like/pass@1"] == pytest.approx(metrics["eval/train_like/accuracy"])


def test_eval_reward_key_picks_from_a_dict_reward(tmp_path):
    data = tmp_path / "dapo.jsonl"
    data.write_text("".join(json.dumps({"input": f"q{i}", "label": str(10 + i)}) + "\n" for i in range(4)))
    config_file = tmp_path / "eval.yaml"
    config_file.write_text(f"eval: {{datasets: [{{name: dapo, path: {data}, rm_type: dapo, n_samples_per_eval_prompt: 2}}]}}")

    def answer(tag, index, k):  # the first sample of prompts 0 and 1 right: 2 of 8
        return f"Answer: {10 + index if k == 0 and index < 2 else 0}"

    results = {}
    for key in (None, "acc"):
        config = MilesConfig(label_key="label", rm_type="exact", eval_config=str(config_file), eval_reward_key=key)
        validate_config(config)
        results[key] = run_evals(config, Rollout(config, AnsweringBackend(answer)), 0, load_eval_datasets(config))
    assert results[None]["eval/dapo/accuracy"] == pytest.approx((2 * 1.0 + 6 * -1.0) / 8)  # dapo's score: +1 / -1
    assert results["acc"]["eval/dapo/accuracy"] == pytest.approx(2 / 8)
