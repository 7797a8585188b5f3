"""``--rollout-function-path`` with slime's contract: ``generate_rollout(args, rollout_id,
data_source, evaluation=False)`` fills the step's groups (rewards included) from the data
source, and the run trains on them; the data source hands out groups as slime's does."""

from __future__ import annotations

import sys
import textwrap
from types import SimpleNamespace

import pytest

from miles_host.cli.main import main
from miles_host.data import PromptDataset, PromptRecord
from miles_host.rollout_function import PromptDataSource
from tests.loop.conftest import base_args, read_metrics


@pytest.fixture
def rollout_module(tmp_path, monkeypatch):
    """A slime-style rollout function: fixed answers "0".."3" per group, reward 1 for "0"."""
    (tmp_path / "my_rollout.py").write_text(textwrap.dedent(
        """
        from types import SimpleNamespace

        from miles_host.sample import Status
        from miles_host.tokenizer_loading import load_tokenizer

        CALLS = []

        def generate_rollout(args, rollout_id, data_source, evaluation=False):
            CALLS.append((rollout_id, evaluation, len(data_source)))
            tokenizer = load_tokenizer(args.hf_checkpoint)
            groups = data_source.get_samples(args.rollout_batch_size)
            for group in groups:
                for i, sample in enumerate(group):
                    prompt = tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
                    answer = tokenizer(str(i), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                    sample.tokens = prompt + answer
                    sample.response = str(i)
                    sample.response_length = len(answer)
                    sample.reward = float(i == 0)
                    sample.status = Status.COMPLETED
            return SimpleNamespace(samples=groups, metrics={"function_groups": len(groups)})
        """
    ))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rollout", None)
    return "my_rollout.generate_rollout"


def test_a_rollout_function_feeds_the_trainer(tiny_task, tmp_path, rollout_module):
    model, data = tiny_task
    args = base_args(model, data, tmp_path / "out", "--num-rollout", "2", "--rollout-function-path", rollout_module)
    assert main([arg for arg in args if arg not in ("--rm-type", "exact")]) == 0  # the function scores
    rows = read_metrics(tmp_path / "out")
    import my_rollout

    assert [call[:2] for call in my_rollout.CALLS] == [(0, False), (1, False)] and my_rollout.CALLS[0][2] == 64
    for row in rows:
        assert row["rollout/reward_mean"] == 0.25 and row["rollout/function_groups"] == 4
        assert row["train/pg_loss"] != 0 and row["train/grad_norm"] > 0
        assert "train/train_rollout_logprob_abs_diff" not in row  # no rollout log-probs: no mismatch metrics


def test_data_source_hands_out_groups_as_slimes_does():
    prompts = [PromptRecord(f"{i}+1=", str(i + 1), {"k": i}, i) for i in range(5)]
    manager = SimpleNamespace(dataset=PromptDataset(prompts, shuffle=False, seed=0), buffer=[], next_group_index=0,
                              tokenizer=None)
    config = SimpleNamespace(n_samples_per_prompt=2, apply_chat_template=False)
    source = PromptDataSource(config, manager)
    first = source.get_samples(2)
    assert [[(s.prompt, s.group_index, s.index, s.label) for s in g] for g in first] == [
        [("0+1=", 0, 0, "1"), ("0+1=", 0, 1, "1")], [("1+1=", 1, 2, "2"), ("1+1=", 1, 3, "2")]]
    assert first[0][0].metadata == {"k": 0, "prompt_index": 0} and first[0][0].tokens == []
    source.add_samples(first[1:])
    again = source.get_samples(2)
    assert again[0] is first[1] and again[1][0].prompt == "2+1=" and again[1][0].group_index == 2
    assert len(source) == 5


def test_slimes_default_rollout_path_is_the_built_in_rollout(tiny_task, tmp_path, capsys):
    """slime's default --rollout-function-path generates with the engine: a reward is still needed."""
    model, data = tiny_task
    args = base_args(model, data, tmp_path / "out", "--rollout-function-path",
                     "slime.rollout.sglang_rollout.generate_rollout", "--dry-run")
    assert main(args) == 0
    assert main([arg for arg in args if arg not in ("--rm-type", "exact")]) == 2
    assert "no reward configured" in capsys.readouterr().err
