"""SGLang's removed MoE switches (``--sglang-enable-ep-moe``, ``--sglang-enable-deepep-moe``, ...)
as deprecated aliases: the option SGLang set in their place, one warning, never passed on.

The expected mappings are SGLang's own deprecation notes ("--enable-ep-moe is deprecated. Please
set `--ep-size` to the same value as `--tp-size` instead.", "--enable-deepep-moe is deprecated.
Please set `--moe-a2a-backend` to 'deepep' instead.", ...).
"""

from __future__ import annotations

import pytest

from miles_host import config_sglang
from miles_host.config import MilesConfig
from miles_host.config_sglang import server_field, server_flags
from miles_host.sglang_args_data import REMOVED_SERVER_SWITCHES, SERVER_ARGS

#: SGLang's deprecation notes: switch -> (option, value); None: the tensor parallel size
SGLANG_NOTES = {
    "enable-ep-moe": ("ep-size", None),
    "enable-deepep-moe": ("moe-a2a-backend", "deepep"),
    "enable-flashinfer-cutlass-moe": ("moe-runner-backend", "flashinfer_cutlass"),
    "enable-flashinfer-cutedsl-moe": ("moe-runner-backend", "flashinfer_cutedsl"),
    "enable-flashinfer-trtllm-moe": ("moe-runner-backend", "flashinfer_trtllm"),
    "enable-triton-kernel-moe": ("moe-runner-backend", "triton_kernel"),
    "enable-flashinfer-mxfp4-moe": ("moe-runner-backend", "flashinfer_mxfp4"),
}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(config_sglang, "_warned_removed", set())


def test_rows_are_removed_switches_onto_pinned_options():
    pinned = {arg.name for arg in SERVER_ARGS}
    assert {switch.name for switch in REMOVED_SERVER_SWITCHES} == set(SGLANG_NOTES)
    for switch in REMOVED_SERVER_SWITCHES:
        assert switch.name not in pinned  # gone from the pinned SGLang: never forwarded as itself
        assert switch.target in pinned


@pytest.mark.parametrize("name", sorted(SGLANG_NOTES))
def test_each_switch_sets_what_sglang_set(name, capsys):
    option, value = SGLANG_NOTES[name]
    config = MilesConfig(**{server_field(name): True}, rollout_num_gpus_per_engine=4)
    expected = 4 if value is None else value
    assert getattr(config, server_field(option)) == expected
    assert server_flags(config) == [f"--{option}", str(expected)]  # the switch itself is not passed on
    err = capsys.readouterr().err
    assert err.count("deprecated SGLang switches") == 1
    assert f"--sglang-{name} (now --sglang-{option} {expected})" in err


def test_deepseek_r1_script_switches_one_warning_line(capsys):
    """slime's DeepSeek-R1 SGLANG_ARGS: both switches, one line, applied once though validated twice."""
    config = MilesConfig(sglang_enable_ep_moe=True, sglang_enable_deepep_moe=True, rollout_num_gpus_per_engine=8,
                         sglang_deepep_mode="low_latency")
    config_sglang.check_sglang_args(config)  # the validation stage runs it again
    assert (config.sglang_ep_size, config.sglang_moe_a2a_backend) == (8, "deepep")
    assert server_flags(config) == ["--ep-size", "8", "--moe-a2a-backend", "deepep", "--deepep-mode", "low_latency"]
    lines = [line for line in capsys.readouterr().err.splitlines() if "deprecated SGLang switches" in line]
    assert len(lines) == 1
    assert "--sglang-enable-ep-moe (now --sglang-ep-size 8), --sglang-enable-deepep-moe" in lines[0]


def test_the_same_value_given_explicitly_is_accepted():
    config = MilesConfig(sglang_enable_ep_moe=True, sglang_ep_size=2, rollout_num_gpus_per_engine=2)
    assert config.sglang_ep_size == 2


@pytest.mark.parametrize("flags, message", [
    ({"sglang_enable_ep_moe": True, "sglang_ep_size": 8, "rollout_num_gpus_per_engine": 4},
     "--sglang-enable-ep-moe sets --sglang-ep-size 4 .* but --sglang-ep-size is 8; give one of the two"),
    ({"sglang_enable_deepep_moe": True, "sglang_moe_a2a_backend": "mooncake"},
     "--sglang-moe-a2a-backend deepep .* but --sglang-moe-a2a-backend is mooncake"),
    ({"sglang_enable_triton_kernel_moe": True, "sglang_enable_flashinfer_cutlass_moe": True},
     "--sglang-enable-triton-kernel-moe sets --sglang-moe-runner-backend triton_kernel .* is flashinfer_cutlass"),
])
def test_a_conflicting_value_is_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        MilesConfig(**flags)


def test_cli_accepts_the_switches(tmp_path, capsys):
    """The flags parse on the command line and reach the config the dry run prints."""
    import json

    from miles_host.cli.main import main

    model = tmp_path / "model"
    from tests.loop.conftest import build_tiny_policy, write_addition_data

    build_tiny_policy(model)
    data = write_addition_data(tmp_path / "data.jsonl", 4)
    code = main(["run", "--hf-checkpoint", str(model), "--prompt-data", str(data), "--label-key", "label",
                 "--rm-type", "exact", "--sglang-enable-ep-moe", "--sglang-enable-deepep-moe", "--dry-run"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    config = json.loads(captured.out)["config"]
    assert (config["sglang_ep_size"], config["sglang_moe_a2a_backend"]) == (1, "deepep")
    assert captured.err.count("deprecated SGLang switches") == 1
