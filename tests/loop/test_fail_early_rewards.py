"""Rewards that block, exit or cannot be found: the sample fails, the run goes on, the
message says why."""

from __future__ import annotations

import json
import random
import re
import string
import sys
import textwrap
import time

import pytest

from miles_host.cli.main import main
from miles_host.rewards.answers import exact_reward, normalize_answer
from tests.loop.conftest import base_args, read_metrics


@pytest.fixture
def blocking_rewards(tmp_path, monkeypatch):
    (tmp_path / "blocking_rewards.py").write_text(textwrap.dedent(
        """
        import asyncio
        import sys
        import time

        def sleeps_on_first(sample, config):
            if sample.index == 0:
                time.sleep(3600)
            return 1.0

        async def async_sleeps_on_first(sample, config):
            if sample.index == 0:
                await asyncio.sleep(3600)
            return 1.0

        def exits_on_first(sample, config):
            if sample.index == 0:
                sys.exit(3)
            return 1.0
        """
    ))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("blocking_rewards", None)
    return "blocking_rewards"


def _failures(out, rollout_id=0) -> list[str]:
    lines = (out / "rollouts" / f"rollout_{rollout_id:05d}.jsonl").read_text().splitlines()
    return [json.loads(line)["metadata"].get("failure") for line in lines if '"failed"' in line]


@pytest.mark.parametrize("function", ["sleeps_on_first", "async_sleeps_on_first"])
def test_a_reward_that_blocks_fails_its_sample_after_rm_timeout(tiny_task, tmp_path, blocking_rewards, function):
    model, data = tiny_task
    out = tmp_path / "o"
    started = time.monotonic()
    args = base_args(model, data, out, "--num-rollout", "2", "--custom-rm-path", f"{blocking_rewards}.{function}",
                     "--rm-timeout", "0.5", "--dump-rollouts")
    assert main(args) == 0
    assert time.monotonic() - started < 60
    assert [r["rollout/failed_samples"] for r in read_metrics(out)] == [1, 0]  # the first sample of the run
    (failure,) = _failures(out)
    assert "RewardTimeout" in failure and "--rm-timeout 0.5" in failure, failure


def test_sys_exit_in_a_reward_fails_the_sample_not_the_run(tiny_task, tmp_path, blocking_rewards):
    model, data = tiny_task
    out = tmp_path / "o"
    args = base_args(model, data, out, "--num-rollout", "2", "--custom-rm-path", f"{blocking_rewards}.exits_on_first",
                     "--dump-rollouts")
    assert main(args) == 0
    assert [r["rollout_id"] for r in read_metrics(out)] == [0, 1]
    (failure,) = _failures(out)
    assert "sys.exit(3)" in failure, failure


def test_a_reward_module_in_the_current_directory_is_imported(tiny_task, tmp_path, monkeypatch):
    model, data = tiny_task
    here = tmp_path / "work"
    here.mkdir()
    (here / "my_reward_in_cwd.py").write_text("def score(sample, config):\n    return 0.5\n")
    monkeypatch.chdir(here)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(here))])
    sys.modules.pop("my_reward_in_cwd", None)
    out = tmp_path / "o"
    assert main(base_args(model, data, out, "--num-rollout", "1", "--custom-rm-path", "my_reward_in_cwd.score")) == 0
    assert read_metrics(out)[0]["rollout/reward_mean"] == 0.5


def test_a_reward_module_that_cannot_be_imported_says_where_it_looked(tiny_task, tmp_path, monkeypatch, capsys):
    model, data = tiny_task
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main(base_args(model, data, tmp_path / "o", "--custom-rm-path", "no_such_reward_module.score")) == 2
    err = capsys.readouterr().err
    assert "--custom-rm-path" in err and "current directory" in err and str(tmp_path) in err, err


def _normalize_reference(text: str) -> str:
    """SQuAD's normalisation, written out character by character."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def test_normalize_answer_matches_squad_and_is_linear():
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.punctuation + " \t\nthe an a" + "éß"
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert normalize_answer(text) == _normalize_reference(text), text
    label = "The answer, (a) 42! " * 100_000  # 2 MB
    started = time.perf_counter()
    assert exact_reward("42", label) == 0.0
    # 0.23 s measured per normalisation (a 20 MB label: 2.6 s); the version that built a set
    # of the punctuation per character took 3.8 s here (20 MB: ~40 s)
    assert time.perf_counter() - started < 1.5
