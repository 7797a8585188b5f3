"""Runs that would train on nothing stop after the first such rollout, with the cause.

Each case makes every sample of a rollout fail (reward code, reward server, prompts,
tokenizer, engine limits): the run exits 1 naming ``--max-failed-sample-fraction`` and
the first failure, instead of logging ``train/skipped_no_samples`` and exiting 0."""

from __future__ import annotations

import http.server
import json
import shutil
import sys
import textwrap
import threading

import pytest

from miles_host.checkpoint import load_checkpoint
from miles_host.cli.main import main
from tests.loop.conftest import base_args, read_metrics

REWARDS = textwrap.dedent(
    """
    import math
    import torch

    def name_error(sample, config):
        return undefined_name

    def one_argument(sample):
        return 1.0

    def returns_none(sample, config):
        return None

    def returns_list(sample, config):
        return [1.0]

    def returns_tensor(sample, config):
        return torch.tensor(1.0)

    def returns_word(sample, config):
        return "correct"

    def returns_nan(sample, config):
        return math.nan

    def returns_inf(sample, config):
        return -math.inf

    async def async_raises(sample, config):
        raise RuntimeError("judge unavailable")

    def group_wrong_length(samples, config):
        return [1.0]

    def group_raises(samples, config):
        raise KeyError("answer")

    JUDGE = {"away_from_rollout": None}

    def judge_that_goes_away(sample, config):
        away = JUDGE["away_from_rollout"]
        if away is not None and sample.metadata["rollout_id"] >= away:
            raise RuntimeError("judge went away")
        return float(sample.response[:1] in ("1", "3", "5", "7", "9", "+"))

    def huge(sample, config):
        return 1e30 * float(sample.response[:1] in ("1", "3", "5", "7", "9", "+"))

    def half_nan(sample, config):
        return float(len(sample.response)) if sample.index % 2 else math.nan
    """
)


@pytest.fixture
def rewards(tmp_path, monkeypatch):
    (tmp_path / "bad_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("bad_rewards", None)
    return "bad_rewards"


def _assert_stopped(code, err, out, *causes):
    assert code == 1, err
    assert "rollout 0:" in err and "--max-failed-sample-fraction" in err, err
    for cause in causes:
        assert cause in err, (cause, err)
    assert not (out / "metrics.jsonl").exists() or read_metrics(out) == []


@pytest.mark.parametrize("function,causes", [
    ("name_error", ["NameError", "undefined_name", "--custom-rm-path bad_rewards.name_error"]),
    ("one_argument", ["TypeError", "positional argument"]),
    ("returns_none", ["a reward must be a number", "NoneType"]),
    ("returns_list", ["a reward must be a number", "list"]),
    ("returns_tensor", ["a reward must be a number", "Tensor", "x.item()"]),
    ("returns_word", ["a reward must be a number", "'correct'"]),
    ("returns_nan", ["the reward is nan", "finite"]),
    ("returns_inf", ["the reward is -inf"]),
    ("async_raises", ["RuntimeError: judge unavailable"]),
])
def test_a_reward_failing_every_sample_stops_the_run(tiny_task, tmp_path, rewards, capsys, function, causes):
    model, data = tiny_task
    out = tmp_path / "out"
    code = main(base_args(model, data, out, "--num-rollout", "3", "--custom-rm-path", f"{rewards}.{function}"))
    _assert_stopped(code, capsys.readouterr().err, out, *causes)


@pytest.mark.parametrize("function,cause", [
    ("group_wrong_length", "group reward returned 1 rewards for 4 samples"),
    ("group_raises", "KeyError: 'answer'"),
])
def test_a_group_reward_failing_every_group_stops_the_run(tiny_task, tmp_path, rewards, capsys, function, cause):
    model, data = tiny_task
    out = tmp_path / "out"
    code = main(base_args(model, data, out, "--num-rollout", "3", "--custom-rm-path", f"{rewards}.{function}",
                          "--group-rm"))
    _assert_stopped(code, capsys.readouterr().err, out, cause)


class _Judge(http.server.BaseHTTPRequestHandler):
    mode = "500"

    def do_POST(self):  # noqa: N802 - http.server's naming
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b"<html>busy</html>"
        self.send_response(500 if self.mode == "500" else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("mode,cause", [
    ("down", "Connection refused"),
    ("500", "HTTP Error 500"),
    ("not_json", "JSONDecodeError"),
])
def test_a_reward_server_that_is_down_or_broken_stops_the_run(tiny_task, tmp_path, capsys, mode, cause):
    model, data = tiny_task
    handler = type("Judge", (_Judge,), {"mode": mode})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    port = server.server_address[1]
    if mode == "down":
        server.server_close()
    else:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = tmp_path / "out"
        url = f"http://127.0.0.1:{port}/reward"
        code = main(base_args(model, data, out, "--num-rollout", "2", "--rm-url", url, "--rm-max-retries", "0"))
    finally:
        if mode != "down":
            server.shutdown()
    _assert_stopped(code, capsys.readouterr().err, out, f"--rm-url {url}", cause)


def test_every_prompt_longer_than_the_context_stops_the_run(tiny_task, tmp_path, capsys):
    model, data = tiny_task
    out = tmp_path / "out"
    code = main(base_args(model, data, out, "--num-rollout", "2", "--rollout-max-context-len", "3"))
    _assert_stopped(code, capsys.readouterr().err, out, "rollout:")


def test_a_tolerated_fraction_of_failures_trains_on_the_rest(tiny_task, tmp_path, rewards):
    """Half the samples with a NaN reward: they fail alone (not the step) and the others train."""
    model, data = tiny_task
    out = tmp_path / "out"
    assert main(base_args(model, data, out, "--num-rollout", "2", "--custom-rm-path", f"{rewards}.half_nan",
                          "--dump-rollouts")) == 0
    rows = read_metrics(out)
    assert [r["rollout/failed_samples"] for r in rows] == [8, 8]
    assert all("train/nan_step_skipped" not in r and r["train/grad_norm"] > 0 for r in rows)
    dumped = [json.loads(line) for line in (out / "rollouts" / "rollout_00000.jsonl").read_text().splitlines()]
    failed = [d for d in dumped if d["status"] == "failed"]
    assert len(failed) == 8 and all("the reward is nan" in d["metadata"]["failure"] for d in failed)


def test_failures_after_good_rollouts_stop_with_the_last_completed_rollout_saved(tiny_task, tmp_path, rewards, capsys):
    """The judge goes away in rollout 1: exit 1 with rollout 0 saved; once it is back, the
    resumed run gives the metrics of a run that never failed."""
    import importlib

    judge = importlib.import_module(rewards).JUDGE
    model, data = tiny_task
    straight, failed, resumed, ckpt = tmp_path / "straight", tmp_path / "failed", tmp_path / "resumed", tmp_path / "ckpt"
    reward = ("--custom-rm-path", f"{rewards}.judge_that_goes_away")
    assert main(base_args(model, data, straight, "--num-rollout", "3", *reward)) == 0
    judge["away_from_rollout"] = 1
    assert main(base_args(model, data, failed, "--num-rollout", "3", *reward, "--save", str(ckpt))) == 1
    err = capsys.readouterr().err
    assert "rollout 1:" in err and "judge went away" in err and "--max-failed-sample-fraction" in err, err
    assert [r["rollout_id"] for r in read_metrics(failed)] == [0]
    state = load_checkpoint(str(ckpt))
    assert state["rollout_id"] == 0 and state["data"]["offset"] == 4  # rollout 1's prompts are redone
    judge["away_from_rollout"] = None
    assert main(base_args(model, data, resumed, "--num-rollout", "3", *reward, "--load", str(ckpt))) == 0
    expected = read_metrics(straight)
    got = read_metrics(failed) + read_metrics(resumed)
    assert [r["rollout_id"] for r in got] == [0, 1, 2]
    for want, have in zip(expected, got):
        for key in want:
            if not key.startswith("perf/"):
                assert have[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key


def test_an_hf_directory_without_tokenizer_files_is_refused_at_load(tiny_task, tmp_path, capsys):
    model, data = tiny_task
    bare = tmp_path / "bare_model"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (model / name).exists():
            shutil.copy(model / name, bare / name)
    assert main(base_args(bare, data, tmp_path / "out", "--num-rollout", "2")) == 2
    err = capsys.readouterr().err
    assert f"--hf-checkpoint {bare}" in err and "tokenizer there is empty" in err


def test_nan_in_hf_weights_is_refused_at_load_naming_the_tensor(tiny_task, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    model, data = tiny_task
    damaged = shutil.copytree(model, tmp_path / "nan_model")
    tensors = load_file(damaged / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][0, 3] = float("nan")
    save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})
    assert main(base_args(damaged, data, tmp_path / "out", "--num-rollout", "2")) == 2
    err = capsys.readouterr().err
    assert "model.safetensors: tensor 'model.layers.1.mlp.down_proj.weight' holds NaN" in err


def test_a_gradient_of_exactly_zero_for_three_rollouts_is_a_warning_naming_the_cause(tiny_task, tmp_path, rewards,
                                                                                       capsys):
    """A reward that is the same for every response: GRPO's advantages are all 0."""
    model, data = tiny_task
    (tmp_path / "same_reward.py").write_text("def one(sample, config):\n    return 1.0\n")
    out = tmp_path / "out"
    assert main(base_args(model, data, out, "--num-rollout", "3", "--custom-rm-path", "same_reward.one")) == 0
    err = capsys.readouterr().err
    assert [r["train/grad_norm"] for r in read_metrics(out)] == [0.0, 0.0, 0.0]
    assert "train/grad_norm has been exactly 0 for 3 rollouts in a row" in err
    assert "every response got the same reward, so every advantage is 0" in err


def test_a_collapsed_policy_is_named_as_the_cause_of_a_zero_gradient():
    from types import SimpleNamespace

    from miles_host.config import MilesConfig
    from miles_host.health import ZeroGradientWatch
    from miles_host.sample import Sample, Status

    def group(tokens, rewards):
        return [Sample(tokens=list(tokens), reward=r, status=Status.COMPLETED) for r in rewards]

    collapsed = [group([5, 6, 7], [1.0, 1.0]), group([8, 9], [0.0, 0.0])]
    watch = ZeroGradientWatch(MilesConfig(lr=10.0), stream=SimpleNamespace(write=lambda text: None))
    messages = [watch.observe({"train/grad_norm": 0.0}, collapsed, float) for _ in range(3)]
    assert messages[:2] == [None, None]
    assert "the policy has collapsed (too large a step: --lr 10?)" in messages[2]
    assert watch.observe({"train/grad_norm": 0.5}, collapsed, float) is None and watch.streak == 0
    singletons = [group([5, 6], [1.0]), group([7], [0.0])]
    messages = [watch.observe({"train/grad_norm": 0.0}, singletons, float) for _ in range(3)]
    assert "each prompt has one scored sample" in messages[2]


def test_failing_samples_stop_the_run_under_dynamic_sampling_too(tiny_task, tmp_path, rewards, capsys):
    """The filter drops every failed group, so the rollout would resubmit prompts until its
    limit; it stops as soon as a batch's worth of samples has finished."""
    model, data = tiny_task
    out = tmp_path / "out"
    code = main(base_args(model, data, out, "--num-rollout", "2", "--custom-rm-path", f"{rewards}.async_raises",
                          "--over-sampling-batch-size", "8"))
    err = capsys.readouterr().err
    _assert_stopped(code, err, out, "RuntimeError: judge unavailable")
    assert "32 of 32 samples failed" in err  # the first chunk of 8 prompts, not 64 x 4 groups later


def test_rewards_of_1e30_still_train(tiny_task, tmp_path, rewards):
    """GRPO's group statistics in float64: a float32 variance of 1e60 would be inf and zero
    every advantage (grad_norm 0)."""
    model, data = tiny_task
    out = tmp_path / "out"
    assert main(base_args(model, data, out, "--num-rollout", "2", "--custom-rm-path", f"{rewards}.huge")) == 0
    rows = read_metrics(out)
    assert all(r["rollout/reward_mean"] > 1e28 and 0 < r["train/grad_norm"] < 1e6 for r in rows), rows
