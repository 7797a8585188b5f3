"""--buffer-filter-path: slime's buffer_filter(args, rollout_id, buffer, num_samples) picks the
partial-rollout groups the next rollout continues; the rest waits."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from miles_host.buffer_filter import take_buffered
from miles_host.cli.main import main
from tests.loop.conftest import base_args, read_metrics


class Config:
    buffer_filter_path = "x.y"
    rollout_batch_size = 2


def test_without_the_flag_every_group_is_taken():
    class Plain:
        buffer_filter_path = None

    buffer = [["a"], ["b"], ["c"]]
    assert take_buffered(Plain(), 0, buffer) == ([["a"], ["b"], ["c"]], [])


def test_the_filter_pops_what_it_takes_and_the_rest_waits():
    def last_first(args, rollout_id, buffer, num_samples):
        taken = buffer[::-1][:num_samples]
        for group in taken:
            buffer.remove(group)
        return taken

    buffer = [["a"], ["b"], ["c"]]
    assert take_buffered(Config(), 3, buffer, last_first) == ([["c"], ["b"]], [["a"]])
    with pytest.raises(TypeError, match="list\\[list\\[Sample\\]\\]"):
        take_buffered(Config(), 3, buffer, lambda *args: None)


@pytest.fixture
def filter_module(tmp_path, monkeypatch):
    log = tmp_path / "calls.jsonl"
    (tmp_path / "my_buffer.py").write_text(textwrap.dedent(f"""
        import json

        def take_one(args, rollout_id, buffer, num_samples):
            with open({str(log)!r}, "a") as handle:
                handle.write(json.dumps({{"rollout_id": rollout_id, "buffered": len(buffer), "n": num_samples}}) + "\\n")
            return [buffer.pop(0)]

        def keep_all(args, group):
            return True
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield log
    sys.modules.pop("my_buffer", None)


def test_a_partial_rollout_run_with_a_buffer_filter(tiny_task, tmp_path, filter_module):
    model, data = tiny_task
    out = tmp_path / "out"
    assert main(base_args(model, data, out, "--num-rollout", "3", "--partial-rollout", "--over-sampling-batch-size", "8",
                          "--dynamic-sampling-filter-path", "my_buffer.keep_all", "--buffer-filter-path", "my_buffer.take_one")) == 0
    calls = [json.loads(line) for line in filter_module.read_text().splitlines()]
    assert calls and all(call["n"] == 4 and call["buffered"] >= 1 for call in calls)
    assert [call["rollout_id"] for call in calls] == sorted({call["rollout_id"] for call in calls})
    metrics = [m for m in read_metrics(out) if "rollout/buffered_samples" in m]
    assert len(metrics) == 3
    # each call sees the whole buffer the previous rollout ended with (groups of 4): what the
    # filter did not take waited, on top of the new surplus
    assert len(calls) == 2
    for call in calls:
        assert call["buffered"] == metrics[call["rollout_id"] - 1]["rollout/buffered_samples"] // 4
    assert metrics[2]["rollout/buffered_samples"] > metrics[1]["rollout/buffered_samples"]


def test_fully_async_refuses_the_hooks_it_does_not_run():
    from miles_host.config import MilesConfig
    from miles_host.config_eval_rewards import check_eval_rewards

    for flag in ("rollout_sample_filter_path", "buffer_filter_path", "custom_reward_post_process_path"):
        with pytest.raises(ValueError, match="with --fully-async"):
            check_eval_rewards(MilesConfig(fully_async=True, **{flag: "m.f"}))
