"""Debug replay: ``--save-debug-rollout-data`` dumps each step's samples; ``--load-debug-rollout-data
--debug-train-only`` trains on them with no engine and gives the original steps' training
metrics exactly (CPU, tiny model, one process); ``--debug-rollout-only`` generates without training."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from miles_host.cli.main import main
from miles_host.debug_rollout import NoEngine, load_debug_rollout_data, subsample
from miles_host.health import TooManyFailedSamples
from miles_host.sample import Sample
from tests.loop.conftest import base_args, read_metrics


@pytest.fixture
def varied_reward(tmp_path, monkeypatch):
    """A reward with variance inside a group, so the steps train (non-zero advantages)."""
    (tmp_path / "replay_rewards.py").write_text(textwrap.dedent(
        """
        def odd_first_char(sample, config):
            return float(sample.response[:1] in ("1", "3", "5", "7", "9", "+"))
        """
    ))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("replay_rewards", None)
    return ["--custom-rm-path", "replay_rewards.odd_first_char"]


def run_args(tiny_task, out, reward, *extra):
    model, data = tiny_task
    args = base_args(model, data, out, "--num-rollout", "2", "--lr", "2e-2", "--global-batch-size", "8",
                     "--micro-batch-size", "3", *reward, *extra)
    return [arg for arg in args if arg not in ("--rm-type", "exact")]


def test_replay_gives_the_original_training_metrics(tiny_task, tmp_path, varied_reward):
    dumps = str(tmp_path / "dumps" / "rollout_{rollout_id}.pt")
    assert main(run_args(tiny_task, tmp_path / "original", varied_reward, "--save-debug-rollout-data", dumps)) == 0
    assert main(run_args(tiny_task, tmp_path / "replay", varied_reward, "--load-debug-rollout-data", dumps,
                         "--debug-train-only")) == 0
    original, replay = read_metrics(tmp_path / "original"), read_metrics(tmp_path / "replay")
    assert len(original) == len(replay) == 2
    for before, after in zip(original, replay):
        compared = [key for key in before if key.startswith(("train/", "rollout/")) and key != "rollout/weight_version"]
        assert before["train/grad_norm"] > 0 and before["train/pg_loss"] != 0
        assert {key: after[key] for key in compared} == {key: before[key] for key in compared}
        assert after["perf/weight_sync_time_s"] == 0.0  # no engine to push to


def test_saved_file_is_slimes_layout(tiny_task, tmp_path, varied_reward):
    dumps = str(tmp_path / "rollout_{rollout_id}.pt")
    assert main(run_args(tiny_task, tmp_path / "out", varied_reward, "--save-debug-rollout-data", dumps,
                         "--debug-rollout-only")) == 0
    payload = torch.load(tmp_path / "rollout_0.pt", weights_only=True)
    assert payload["rollout_id"] == 0 and len(payload["samples"]) == 16  # 4 prompts x 4 samples
    samples = [Sample.from_dict(data) for data in payload["samples"]]
    assert all(len(s.rollout_log_probs) == s.response_length for s in samples)
    groups, stats = load_debug_rollout_data(dumps, 1)
    assert [len(g) for g in groups] == [4, 4, 4, 4]
    assert all(len({s.group_index for s in g}) == 1 for g in groups)
    rows = read_metrics(tmp_path / "out")
    assert len(rows) == 2 and not any(key.startswith("train/") for row in rows for key in row)
    assert all("rollout/reward_mean" in row for row in rows)


def test_train_only_starts_no_engine(tiny_task, tmp_path, varied_reward, monkeypatch):
    import miles_host.loop as loop
    from miles_host.cli.main import resolve_run_config
    from miles_host.plugin_manager import MilesPluginManager
    from miles_host.protocols import RolloutBackend

    built = []
    original_build = loop.build

    def recording_build(registry, name, protocol, *args):
        built.append(protocol)
        return original_build(registry, name, protocol, *args)

    monkeypatch.setattr(loop, "build", recording_build)
    manager = MilesPluginManager()
    manager.discover()
    dumps = str(tmp_path / "rollout_{rollout_id}.pt")
    flags = run_args(tiny_task, tmp_path / "o", varied_reward, "--load-debug-rollout-data", dumps)[1:]
    config, _ = resolve_run_config(flags, manager)
    run = loop.Run(config, manager)
    try:
        assert isinstance(run.backend, NoEngine) and RolloutBackend not in built and built
        with pytest.raises(TooManyFailedSamples, match="no rollout engine was started"):
            run.rollout.generate(0)  # the built-in rollout has no engine to generate with
    finally:
        run.close()
    # the built-in rollout alone cannot feed a --debug-train-only run: refused before anything starts
    assert main(run_args(tiny_task, tmp_path / "o2", varied_reward, "--debug-train-only")) == 2


def test_subsample_keeps_the_first_and_last_halves():
    rows = list(range(10))
    assert subsample(rows, 0.4) == [0, 1, 8, 9]
    assert subsample(rows, None) == rows


def test_flags_are_checked(tmp_path):
    from miles_host.config import MilesConfig

    with pytest.raises(ValueError, match="cannot be set at the same time"):
        MilesConfig(debug_rollout_only=True, debug_train_only=True)
    with pytest.raises(ValueError, match="implies --debug-train-only"):
        MilesConfig(debug_rollout_only=True, load_debug_rollout_data="x_{rollout_id}.pt")
    with pytest.raises(ValueError, match=r"the placeholders are \{rollout_id\} "):
        MilesConfig(save_debug_rollout_data="x_{step}.pt")
    with pytest.raises(ValueError, match=r"--save-debug-train-data .*the placeholders are \{rollout_id\}, \{rank\}"):
        MilesConfig(save_debug_train_data="x_{rollout_id}_{step}.pt")
    MilesConfig(save_debug_train_data="x_{rollout_id}_{rank}.pt")
    with pytest.raises(ValueError, match="no rollout engine"):
        MilesConfig(debug_train_only=True, eval_prompt_data=["a", "b.jsonl"])
    with pytest.raises(FileNotFoundError, match="--save-debug-rollout-data"):
        load_debug_rollout_data(str(tmp_path / "missing_{rollout_id}.pt"), 3)


def test_dump_details_writes_slimes_rollout_and_train_data(tiny_task, tmp_path, varied_reward):
    """``--dump-details DIR``: slime's rollout_data/{rollout_id}.pt and train_data/{rollout_id}_{rank}.pt; the
    train data's log-probs of step 0 (one optimizer step a rollout: the initial model's) equal transformers'
    float64 log-softmax of the same tokens, and the rollout dump replays."""
    from transformers import AutoModelForCausalLM

    model_dir, _ = tiny_task
    dump = tmp_path / "dump"
    args = [arg for arg in base_args(*tiny_task, tmp_path / "out", "--num-rollout", "1", "--rollout-temperature", "1.0",
                                     "--dump-details", str(dump), *varied_reward) if arg not in ("--rm-type", "exact")]
    assert main(args) == 0
    assert sorted(p.name for p in (dump / "rollout_data").iterdir()) == ["0.pt"]
    assert sorted(p.name for p in (dump / "train_data").iterdir()) == ["0_0.pt"]
    rollout = torch.load(dump / "rollout_data" / "0.pt", weights_only=True)
    train = torch.load(dump / "train_data" / "0_0.pt", weights_only=True)
    assert train["rollout_id"] == 0 and train["rank"] == 0
    data = train["rollout_data"]
    assert data["tokens"] == [s["tokens"] for s in rollout["samples"]]
    assert data["rollout_log_probs"] == [s["rollout_log_probs"] for s in rollout["samples"]]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    for tokens, length, log_probs in zip(data["tokens"], data["response_lengths"], data["log_probs"]):
        assert len(log_probs) == length
        with torch.no_grad():
            logits = reference(torch.tensor([tokens])).logits[0, :-1]
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0][-length:]
        torch.testing.assert_close(torch.tensor(log_probs, dtype=torch.float64), want, atol=1e-4, rtol=0)
    groups, _ = load_debug_rollout_data(str(dump / "rollout_data" / "{rollout_id}.pt"), 0)
    assert sum(len(g) for g in groups) == 16
