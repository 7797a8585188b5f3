"""``miles run`` end to end on a tiny CPU model: resume, bad input, NaN, Ctrl-C."""

from __future__ import annotations

import json
import math
import sys
import textwrap

import pytest

from miles_host.cli.main import main
from tests.loop.conftest import base_args, read_metrics


def _comparable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("perf/")}


def test_run_learns_signal_and_logs_required_metrics(tiny_task, tmp_path):
    model, data = tiny_task
    out = tmp_path / "out"
    assert main(base_args(model, data, out, "--num-rollout", "2", "--dump-rollouts")) == 0
    rows = read_metrics(out)
    assert [r["rollout_id"] for r in rows] == [0, 1]
    for key in ("rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/grad_norm",
                "perf/rollout_tok_per_s", "perf/train_tok_per_s", "perf/step_time_s",
                "train/train_rollout_logprob_abs_diff", "train/train_rollout_kl"):
        assert key in rows[0], key
    # one model implementation on both sides: float32 CPU mismatch is rounding only
    assert rows[0]["train/train_rollout_logprob_abs_diff"] < 1e-5
    assert (out / "rollouts" / "rollout_00001.jsonl").is_file()


def test_resume_gives_the_same_metrics(tiny_task, tmp_path):
    model, data = tiny_task
    straight, first, resumed = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert main(base_args(model, data, straight, "--num-rollout", "4")) == 0
    assert main(base_args(model, data, first, "--num-rollout", "2", "--save", str(tmp_path / "ckpt"))) == 0
    assert main(base_args(model, data, resumed, "--num-rollout", "4", "--load", str(tmp_path / "ckpt"))) == 0
    expected = [_comparable(m) for m in read_metrics(straight)]
    got = [_comparable(m) for m in read_metrics(first)] + [_comparable(m) for m in read_metrics(resumed)]
    assert [m["rollout_id"] for m in got] == [0, 1, 2, 3]
    for want, have in zip(expected, got):
        assert want.keys() == have.keys()
        for key in want:
            assert want[key] == pytest.approx(have[key], rel=1e-6, abs=1e-9), key


def test_missing_data_file(tiny_task, tmp_path, capsys):
    model, _ = tiny_task
    assert main(base_args(model, tmp_path / "nope.jsonl", tmp_path / "o")) == 2
    assert "nope.jsonl does not exist" in capsys.readouterr().err


def test_malformed_json_line_names_the_line(tiny_task, tmp_path, capsys):
    model, _ = tiny_task
    data = tmp_path / "bad.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n{"input": "2+2=", "label": \n')
    assert main(base_args(model, data, tmp_path / "o")) == 2
    assert "bad.jsonl:2: malformed JSON" in capsys.readouterr().err


def test_missing_input_key(tiny_task, tmp_path, capsys):
    model, data = tiny_task
    assert main(base_args(model, data, tmp_path / "o", "--input-key", "question")) == 2
    err = capsys.readouterr().err
    assert "no key 'question'" in err and "--input-key" in err


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """A module of custom rewards importable by --custom-rm-path."""
    (tmp_path / "custom_rewards.py").write_text(textwrap.dedent(
        """
        import math
        calls = {"n": 0}

        def flaky(sample, config):
            calls["n"] += 1
            if calls["n"] % 3 == 0:
                raise RuntimeError("judge unavailable")
            return float(sample.response == sample.label)

        def length_reward(sample, config):
            return float(len(sample.response))

        def nan_reward(sample, config):
            return float(len(sample.response)) if sample.index % 2 else math.nan

        def interrupt_on_second_rollout(sample, config):
            if sample.metadata["rollout_id"] == 1:
                raise KeyboardInterrupt
            return 0.0
        """
    ))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("custom_rewards", None)
    return "custom_rewards"


def test_reward_that_raises_fails_the_sample_not_the_run(tiny_task, tmp_path, reward_module):
    model, data = tiny_task
    out = tmp_path / "o"
    args = base_args(model, data, out, "--num-rollout", "2", "--custom-rm-path", f"{reward_module}.flaky", "--dump-rollouts")
    assert main(args) == 0
    rows = read_metrics(out)
    assert sum(r["rollout/failed_samples"] for r in rows) > 0
    dumped = (out / "rollouts" / "rollout_00000.jsonl").read_text()
    assert "judge unavailable" in dumped and '"failed"' in dumped


def test_nan_loss_steps_are_skipped_then_the_run_stops_with_a_checkpoint(tiny_task, tmp_path, reward_module, capsys,
                                                                          monkeypatch):
    from miles_host.trainer import NativeTrainer

    # a NaN reward now fails its sample; a NaN loss comes from the loss itself
    micro_loss = NativeTrainer._micro_loss

    def nan_loss(self, *args):
        loss, metrics = micro_loss(self, *args)
        return loss * float("nan"), metrics

    monkeypatch.setattr(NativeTrainer, "_micro_loss", nan_loss)
    model, data = tiny_task
    out, ckpt = tmp_path / "o", tmp_path / "ckpt"
    args = base_args(model, data, out, "--num-rollout", "5", "--custom-rm-path", f"{reward_module}.length_reward",
                     "--save", str(ckpt), "--max-consecutive-nan-steps", "2")
    assert main(args) == 1
    assert "NaN" in capsys.readouterr().err
    rows = read_metrics(out)
    assert rows[0]["train/nan_step_skipped"] == 1.0 and len(rows) == 1
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1"


def test_ctrl_c_writes_a_checkpoint(tiny_task, tmp_path, reward_module):
    import torch

    model, data = tiny_task
    ckpt = tmp_path / "ckpt"
    args = base_args(model, data, tmp_path / "o", "--num-rollout", "4",
                     "--custom-rm-path", f"{reward_module}.interrupt_on_second_rollout", "--save", str(ckpt))
    assert main(args) == 130
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "0"
    state = torch.load(ckpt / "iter_0000000" / "state.pt", weights_only=False)
    # interrupted while scoring rollout 1: the data position is where rollout 1 began (4 prompts in)
    assert state["data"] == {"epoch": 0, "offset": 4}


def test_prepare_model_hook_runs_before_the_optimizer(tiny_task, tmp_path):
    import torch

    from miles_host.cli.args import resolve_run_config
    from miles_host.plugin_manager import MilesPluginManager
    from miles_host.trainer import NativeTrainer

    roles = []

    class AttachHead:
        @staticmethod
        def miles_prepare_model(model, role, config):
            roles.append(role)
            if role == "train":
                model.extra_head = torch.nn.Linear(4, 4)

    model, data = tiny_task
    manager = MilesPluginManager()
    manager.discover()
    manager.add_inline_plugin(AttachHead(), "attach-head")
    config, _ = resolve_run_config(base_args(model, data, tmp_path)[1:], manager)
    trainer = NativeTrainer(config, manager)
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert all(id(p) in optimized for p in trainer.model.extra_head.parameters())
    assert roles == ["train"]


def test_activation_checkpointing_gives_the_same_training(tiny_task, tmp_path):
    model, data = tiny_task
    plain, recompute = tmp_path / "plain", tmp_path / "recompute"
    assert main(base_args(model, data, plain, "--num-rollout", "2")) == 0
    assert main(base_args(model, data, recompute, "--num-rollout", "2", "--recompute-granularity", "full")) == 0
    for want, have in zip(read_metrics(plain), read_metrics(recompute)):
        for key in ("train/loss", "train/grad_norm", "rollout/reward_mean"):
            assert want[key] == pytest.approx(have[key], rel=1e-6, abs=1e-9), key


def test_custom_generate_function_multi_turn(tiny_task, tmp_path, monkeypatch):
    """A two-turn generation with a tool answer in between: the tool tokens are
    kept in the sample but not trained, and the trainer's log-probs of the
    policy's own tokens still match the rollout's."""
    (tmp_path / "two_turns.py").write_text(textwrap.dedent(
        """
        def generate(args, sample, sampling_params, session):
            first = session.generate(sample.tokens, {**sampling_params, "max_new_tokens": 2, "ignore_eos": True})
            session.append_generation(sample, first)
            tool = session.tokenizer("=7", add_special_tokens=False)["input_ids"]
            session.append_tokens(sample, tool)
            second = session.generate(sample.tokens, {**sampling_params, "max_new_tokens": 2})
            session.append_generation(sample, second)
            sample.metadata["turns"] = 2
            return sample
        """
    ))
    monkeypatch.syspath_prepend(str(tmp_path))
    model, data = tiny_task
    out = tmp_path / "out"
    assert main(base_args(model, data, out, "--num-rollout", "2", "--dump-rollouts",
                          "--custom-generate-function-path", "two_turns.generate")) == 0
    rows = read_metrics(out)
    assert all(r["rollout/failed_samples"] == 0 for r in rows)
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-5 for r in rows)
    samples = [json.loads(line) for line in (out / "rollouts" / "rollout_00000.jsonl").read_text().splitlines()]
    for sample in samples:
        assert sample["metadata"]["turns"] == 2
        assert sample["loss_mask"][:2] == [1, 1] and sample["loss_mask"][2:4] == [0, 0]
        assert len(sample["loss_mask"]) == len(sample["rollout_log_probs"]) == sample["response_length"]


def test_ppo_with_a_critic_learns_the_values(tiny_task, tmp_path, reward_module):
    model, data = tiny_task
    out = tmp_path / "ppo"
    args = base_args(model, data, out, "--num-rollout", "4", "--advantage-estimator", "ppo",
                     "--custom-rm-path", f"{reward_module}.length_reward", "--critic-lr", "1e-2", "--gamma", "1.0",
                     "--lambd", "0.95", "--save", str(tmp_path / "ckpt"))
    assert main(args) == 0
    rows = read_metrics(out)
    losses = [r["critic/value_loss"] for r in rows]
    assert all(math.isfinite(x) for x in losses) and "critic/values_mean" in rows[0]
    assert rows[0]["critic/values_mean"] == 0.0  # zero-initialised head
    assert rows[-1]["critic/values_mean"] != 0.0  # the critic moved
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "3"


def test_remote_reward_over_http(tiny_task, tmp_path):
    import http.server
    import threading

    seen = []

    class Judge(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's naming
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            payload = json.dumps({"score": 0.25 if body["label"] else 0.0}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        model, data = tiny_task
        out = tmp_path / "out"
        url = f"http://127.0.0.1:{server.server_address[1]}/reward"
        assert main(base_args(model, data, out, "--num-rollout", "1", "--rm-url", url)) == 0
    finally:
        server.shutdown()
    assert read_metrics(out)[0]["rollout/reward_mean"] == 0.25
    assert len(seen) == 16 and {"prompt", "response", "label", "metadata"} <= set(seen[0])


def test_save_hf_writes_weights_transformers_loads(tiny_task, tmp_path):
    import torch
    import transformers

    from miles_host.models import load_pretrained

    model, data = tiny_task
    hf_dir = tmp_path / "hf"
    ckpt = tmp_path / "ckpt"
    assert main(base_args(model, data, tmp_path / "o", "--num-rollout", "1", "--save", str(ckpt),
                          "--save-hf", str(hf_dir))) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    ids = torch.tensor([[5, 12, 6, 13]])
    ours = load_pretrained(str(hf_dir))(ids)
    assert torch.allclose(loaded(ids).logits, ours, atol=1e-5)
    trained = torch.load(ckpt / "iter_0000000" / "state.pt", weights_only=False)["trainer"]["model"]
    assert torch.equal(ours.new_tensor(0) + trained["embed_tokens.weight"],
                       load_pretrained(str(hf_dir)).state_dict()["embed_tokens.weight"])


def test_apply_chat_template_and_async_group_reward(tmp_path, monkeypatch):
    """Prompts as chat messages through the tokenizer's template, scored per group
    by an async reward function."""
    from miles_host.quickstart_preset import QUICKSTART_DIR

    (tmp_path / "group_rewards.py").write_text(textwrap.dedent(
        """
        async def score(samples, config):
            assert len(samples) == 4 and len({s.group_index for s in samples}) == 1
            return [float(i) for i in range(len(samples))]
        """
    ))
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"input": [{"role": "user", "content": f"{a}+1="}], "label": str(a + 1)})
                              for a in range(10, 18)) + "\n")
    out = tmp_path / "out"
    assert main(["run", "--hf-checkpoint", str(QUICKSTART_DIR / "model"), "--prompt-data", str(data),
                 "--apply-chat-template", "--custom-rm-path", "group_rewards.score", "--group-rm",
                 "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4",
                 "--num-rollout", "1", "--output-dir", str(out), "--no-progress", "--dump-rollouts"]) == 0
    assert read_metrics(out)[0]["rollout/reward_mean"] == 1.5
    sample = json.loads((out / "rollouts" / "rollout_00000.jsonl").read_text().splitlines()[0])
    assert isinstance(sample["prompt"], list) and sample["prompt"][0]["role"] == "user"


def test_a_prompt_too_long_for_the_context_fails_alone(tiny_task, tmp_path):
    model, _ = tiny_task
    data = tmp_path / "mixed.jsonl"
    rows = [{"input": "1+2=", "label": "3"}, {"input": "1+2+3+4+5+6+7+8=", "label": "36"}] * 4
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out"
    assert main(base_args(model, data, out, "--num-rollout", "2", "--rollout-max-context-len", "10",
                          "--dump-rollouts")) == 0
    metrics = read_metrics(out)
    assert sum(m["rollout/failed_samples"] for m in metrics) > 0
    dumped = [json.loads(line) for line in (out / "rollouts" / "rollout_00000.jsonl").read_text().splitlines()]
    failed = [d for d in dumped if d["status"] == "failed"]
    assert failed and all("rollout:" in d["metadata"]["failure"] for d in failed)
    assert any(d["status"] != "failed" for d in dumped)


def test_a_failing_plugin_hook_or_logger_does_not_stop_the_run(tiny_task, tmp_path):
    from miles_host.cli.args import resolve_run_config
    from miles_host.loop import Run
    from miles_host.plugin_manager import MilesPluginManager

    class Broken:
        @staticmethod
        def miles_step_end(rollout_id, metrics, config):
            raise RuntimeError("metrics service down")

    class Good:
        @staticmethod
        def miles_step_end(rollout_id, metrics, config):
            metrics["good/seen"] = rollout_id

    from miles_host.protocols import MetricsLoggerBase

    class ExplodingLogger(MetricsLoggerBase):
        def log(self, metrics, step):
            raise OSError("disk full")

        def close(self):
            pass

    model, data = tiny_task
    manager = MilesPluginManager()
    manager.discover()
    manager.add_inline_plugin(Broken(), "broken-metrics")
    manager.add_inline_plugin(Good(), "good-metrics")
    config, _ = resolve_run_config(base_args(model, data, tmp_path / "o", "--num-rollout", "2")[1:], manager)
    run = Run(config, manager)
    run.loggers.append(ExplodingLogger())
    with pytest.warns(UserWarning, match="broken-metrics"):
        assert run.run() == 0
    rows = read_metrics(tmp_path / "o")
    assert [r["good/seen"] for r in rows] == [0, 1]
    assert all(r["plugins/step_end_failures"] == 1 for r in rows)
    assert not any(isinstance(logger, ExplodingLogger) for logger in run.loggers)


def test_run_close_frees_the_embedded_engine(tiny_task, tmp_path):
    """``Run.close`` drops the in-process engine (weights, KV cache, graphs), so a second run
    or a benchmark's next case in the same process finds the device memory free."""
    import gc
    import weakref

    from miles_host.cli.args import resolve_run_config
    from miles_host.loop import Run
    from miles_host.plugin_manager import MilesPluginManager

    model, data = tiny_task
    manager = MilesPluginManager()
    manager.discover()
    config, _ = resolve_run_config(base_args(model, data, tmp_path / "o", "--num-rollout", "1")[1:], manager)
    run = Run(config, manager)
    assert run.run() == 0
    engine, kv_cache = weakref.ref(run.backend.engine), weakref.ref(run.backend.engine.kv_cache)
    run.close()
    gc.collect()
    assert engine() is None and kv_cache() is None  # nothing else kept them alive
    run.close()  # a second close is harmless
    with pytest.raises(RuntimeError, match="closed"):
        run.backend.submit("r", [1, 2], {"max_new_tokens": 1})
