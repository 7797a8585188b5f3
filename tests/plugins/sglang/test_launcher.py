"""Servers the sglang backend starts itself when no URL is given."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from miles_sglang.launcher import launch_servers, server_command


def _config(**overrides):
    values = dict(hf_checkpoint="/models/qwen", rollout_num_gpus_per_engine=2, rollout_num_gpus=4,
                  rollout_return_routed_experts=True, sglang_mem_fraction_static=0.7,
                  sglang_speculative_algorithm="EAGLE", sglang_speculative_num_steps=3,
                  sglang_speculative_eagle_topk=1, sglang_speculative_num_draft_tokens=4,
                  sglang_speculative_draft_model_path=None, sglang_enable_draft_weights_cpu_backup=True,
                  dtype="auto", device="cpu", true_on_policy=False, rollout_max_context_len=None,
                  sglang_api_key=None, sglang_server_command="miles", sglang_server_start_timeout=5.0)
    values.update(overrides)
    return SimpleNamespace(**values)


def test_real_sglang_gets_every_server_flag():
    command = server_command(_config(), 30001, "sglang")
    assert command[:3] == [sys.executable, "-m", "sglang.launch_server"]
    joined = " ".join(command)
    for part in ("--model-path /models/qwen", "--port 30001", "--tp-size 2", "--enable-return-routed-experts",
                 "--mem-fraction-static 0.7", "--speculative-algorithm EAGLE", "--speculative-num-steps 3",
                 "--speculative-num-draft-tokens 4", "--enable-draft-weights-cpu-backup"):
        assert part in joined
    assert "--speculative-draft-model-path" not in joined


def test_miles_serve_command_carries_determinism_and_key():
    command = server_command(_config(true_on_policy=True, sglang_api_key="k", rollout_num_gpus_per_engine=1), 30002,
                             "miles")
    assert command[3:5] == ["serve", "--hf-checkpoint"]
    assert "--enable-deterministic-inference" in command and command[-2:] == ["--api-key", "k"]


def test_a_server_that_dies_at_start_is_a_clear_error(tmp_path):
    # the server process needs seconds to import torch before it fails: a loaded CI machine
    # took more than the default 5 s, which turned the exit into a start timeout
    config = _config(hf_checkpoint=str(tmp_path / "no_such_model"), rollout_num_gpus=1, rollout_num_gpus_per_engine=1,
                     sglang_server_start_timeout=120.0)
    with pytest.raises(RuntimeError, match="exited with code"):
        launch_servers(config)
