"""``miles run`` flags, --config files, --dry-run and the usage guide's command lines."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from miles_host.cli.args import build_run_parser
from miles_host.cli.main import main
from miles_host.plugin_manager import MilesPluginManager
from tests.host.seed_commands import SEED_COMMANDS
from tests.run_inputs import run_inputs, write_model_config

REPO = Path(__file__).resolve().parents[2]


def _dry_run(capsys, *argv):
    code = main(["run", *argv, "--dry-run"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


#: seed command lines this version refuses (index -> what the refusal names): one CPU process
#: has no model parallelism for the native trainer, the embedded engine no tensor parallelism,
#: speculative flags without a speculative algorithm are read by nothing, routing replay needs MoE
REFUSED_SEED_COMMANDS = {
    1: "--tensor-model-parallel-size 8",
    4: "--rollout-num-gpus-per-engine 2",
    5: "--tensor-model-parallel-size 8",
    9: "--sglang-speculative-num-steps",
    10: "--sglang-enable-draft-weights-cpu-backup",
    12: "the model has no MoE layers",  # no --hf-checkpoint: the quickstart's dense model, nothing to replay
}


@pytest.mark.parametrize("command", SEED_COMMANDS, ids=range(len(SEED_COMMANDS)))
def test_every_seed_command_line_parses_and_passes_dry_run_or_is_refused_by_name(command, tmp_path, capsys):
    """Every flag of the usage guide's command lines parses; --dry-run accepts the line (then the run starts) or
    refuses it with exit code 2 and a message naming the flag it cannot honour."""
    (tmp_path / "data.jsonl").write_text('{"input": "1+1", "label": "2"}\n')
    write_model_config(tmp_path, moe=True)  # the guide's Qwen3-30B-A3B, tiny
    argv = shlex.split(command.format(ckpt=tmp_path, data=tmp_path / "data.jsonl"))
    assert argv[:2] in (["python", "train.py"], ["miles", "run"])
    flags = argv[2:]
    if "--hf-checkpoint" in flags:  # the guide leaves data and reward out of some lines
        flags += [] if "--prompt-data" in flags else ["--prompt-data", str(tmp_path / "data.jsonl")]
        flags += ["--rm-type", "exact"]
        flags += [] if "--n-samples-per-prompt" in flags else ["--n-samples-per-prompt", "8"]
    index = SEED_COMMANDS.index(command)
    if index in REFUSED_SEED_COMMANDS:
        assert main(["run", *flags, "--dry-run"]) == 2
        assert REFUSED_SEED_COMMANDS[index] in capsys.readouterr().err
        parser, _ = build_run_parser(resolved_manager())
        config = vars(parser.parse_args(flags))
    else:
        report = _dry_run(capsys, *flags)
        config = {**report["config"], **report["config"]["plugin_args"]}
    for flag in [a for a in argv[2:] if a.startswith("--") and a != "--plugins"]:
        name = flag[2:].replace("-", "_")
        name = {"tis_threshold": "tis_clip"}.get(name, name)
        assert name in config, flag


def resolved_manager():
    manager = MilesPluginManager()
    manager.discover()
    return manager


def test_seed_values_are_resolved(capsys, tmp_path):
    config = _dry_run(capsys, "--use-tis", "--tis-threshold", "0.9", "--rollout-batch-size", "512")["config"]
    assert config["use_tis"] is True and config["tis_clip"] == 0.9 and config["rollout_batch_size"] == 512


def test_speculative_flags_activate_the_spec_plugin(capsys):
    report = _dry_run(capsys, "--sglang-speculative-algorithm", "EAGLE")
    assert "spec" in report["config"]["plugins"]
    assert "spec" in [p["name"] for p in report["active_plugins"]]


def test_plugins_flag_activates_and_configures(capsys):
    config = _dry_run(capsys, *run_inputs(moe=True), "--plugins", "fp8,r3", "--plugins", "spec")["config"]
    assert config["plugins"] == ["fp8", "r3", "spec"] or set(config["plugins"]) == {"fp8", "r3", "spec"}
    assert config["precision"] == "fp8"
    assert config["plugin_args"]["use_rollout_routing_replay"] is True


def test_slime_routing_replay_flag_activates_r3(capsys):
    config = _dry_run(capsys, *run_inputs(moe=True), "--use-rollout-routing-replay")["config"]
    assert config["plugins"] == ["r3"]


def test_routing_replay_on_a_dense_model_is_refused_by_dry_run(capsys):
    assert main(["run", *run_inputs(), "--use-rollout-routing-replay", "--dry-run"]) == 2
    assert "the model has no MoE layers" in capsys.readouterr().err


def test_config_file_with_flags_overriding(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("rollout-batch-size: 16\nn_samples_per_prompt: 4\nlr: 1.0e-5\n")
    config = _dry_run(capsys, *run_inputs(), "--config", str(path), "--n-samples-per-prompt", "8")["config"]
    assert config["rollout_batch_size"] == 16
    assert config["n_samples_per_prompt"] == 8
    assert config["lr"] == 1e-5


def test_config_file_unknown_key_suggests(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("rollout_batch_sise: 16\n")
    assert main(["run", "--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "rollout_batch_sise" in err and "rollout_batch_size" in err


def test_missing_config_file(capsys):
    assert main(["run", "--config", "/nonexistent/run.yaml", "--dry-run"]) == 2
    assert "/nonexistent/run.yaml" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rollout-batch-size", "0"], "--rollout-batch-size must be positive"),
        (["--rollout-top-p", "1.5"], "--rollout-top-p"),
        (["--eval-prompt-data", "gsm8k"], "--eval-prompt-data takes pairs"),
        (["--use-dynamic-batch-size"], "--max-tokens-per-gpu"),
        (["--rollout-batch-size", "8", "--over-sampling-batch-size", "4"], "--over-sampling-batch-size"),
    ],
)
def test_bad_values_name_the_flag(argv, message, capsys):
    assert main(["run", *argv, "--dry-run"]) == 2
    assert message in capsys.readouterr().err


def test_unknown_command(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_train_py_forwards_to_miles_run(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--rollout-batch-size", "3", "--dry-run"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["config"]["rollout_batch_size"] == 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--advantage-estimator", "grpoo"], "unknown advantage estimator 'grpoo'"),
        (["--rm-type", "mth"], "unknown reward function 'mth'"),
        (["--weight-sync", "carrier-pigeon"], "unknown weight-sync transport"),
    ],
)
def test_registry_typos_fail_in_dry_run(argv, message, capsys):
    assert main(["run", *argv, "--dry-run"]) == 2
    assert message in capsys.readouterr().err


def test_missing_model_directory_is_named_before_any_work(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "1+1="}\n')
    assert main(["run", "--hf-checkpoint", str(tmp_path / "nope"), "--prompt-data", str(data),
                 "--rm-type", "exact", "--output-dir", str(tmp_path / "out")]) == 2
    assert "no config.json there" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
