"""The one validation stage: ``--dry-run`` refuses what the run refuses, with the same
message; plugins never overwrite flags the user gave; every flag is read or listed."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from miles_host import records
from miles_host.cli.args import resolve_run_config
from miles_host.cli.main import main
from miles_host.config import MilesConfig
from miles_host.config_sglang import ROUTER_ARGS_BY_FIELD, SERVER_ARGS_BY_FIELD, server_field
from miles_host.sglang_args_data import REMOVED_SERVER_SWITCHES
from miles_host.plugin_manager import MilesPluginManager
from miles_host.validation import ACCEPTED_AND_IGNORED, validate
from miles_host.validation import ignored_flags
from miles_megatron.plugin import megatron_available
from tests.run_inputs import run_input_folder, run_inputs

REPO = Path(__file__).resolve().parents[2]

#: settings the run refuses, and a part of the message naming what is wrong
REFUSED = [
    (["--train-backend", "native", "--sequence-parallel"],
     "--sequence-parallel splits the sequence over tensor-parallel ranks"),
    (["--train-backend", "native", "--tensor-model-parallel-size", "2"],
     "--tensor-model-parallel-size 2 is not supported by --train-backend native"),
    (["--train-backend", "native", "--context-parallel-size", "2"], "--context-parallel-size 2"),
    (["--recompute-method", "uniform"], "need --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-method", "block"], "--recompute-method block"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "4"], "--recompute-num-layers 4"),
    (["--sglang-speculative-num-steps", "2"], "--sglang-speculative-num-steps is read only by speculative decoding"),
    (["--sglang-enable-draft-weights-cpu-backup"], "--sglang-enable-draft-weights-cpu-backup is read only"),
    (["--mtp-num-layers", "1"], "--mtp-num-layers is read only by the MTP draft"),
    (["--mtp-loss-scaling-factor", "0.5"], "--mtp-loss-scaling-factor is read only by the MTP draft"),
    (["--plugins", "fp8", "--precision", "bf16"], "plugin 'fp8' sets --precision fp8, but --precision bf16 was given"),
    (["--plugins", "fp8,int4"], "both set --precision"),
    (["--plugins", "fp8", "--fp8-format", "hybrid"], "--fp8-format hybrid is not supported by miles-fp8"),
    (["--sglang-speculative-algorithm", "EAGLE", "--true-on-policy"], "--true-on-policy with --sglang-speculative"),
    (["--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-eagle-topk", "2"], "only chain drafting"),
    (["--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "0"], "must be >= 1"),
    (["--sglang-speculative-algorithm", "medusa"], "unknown decoding strategy 'medusa'"),
    (["--custom-rm-path", "no_such_module_anywhere.reward"], "--custom-rm-path 'no_such_module_anywhere.reward'"),
    (["--dynamic-sampling-filter-path", "os.no_such_function"], "--dynamic-sampling-filter-path"),
    (["--rollout-backend", "sglang", "--lora-rank", "2", "--lora-sync", "adapter"],
     "--lora-sync adapter with --rollout-backend sglang"),
    (["--rollout-backend", "embedded", "--rollout-num-gpus-per-engine", "2"],
     "the embedded engine (--rollout-backend embedded) runs on one GPU"),
    (["--advantage-estimator", "ppo", "--actor-num-gpus-per-node", "2"], "trains a critic"),
    (["--hf-checkpoint", "/nonexistent/model"], "no config.json there"),
    (["--prompt-data", "/nonexistent/prompts.jsonl"], "/nonexistent/prompts.jsonl"),
    (["--rm-type", "mth"], "unknown reward function 'mth'"),
    (["--weight-sync", "carrier-pigeon"], "unknown weight-sync transport"),
    (["--rollout-batch-size", "0"], "--rollout-batch-size must be positive"),
    (["--use-session-server"], "--use-session-server serves the trajectories of a --custom-generate-function-path"),
    (["--sglang-server-concurrency", "0"], "--sglang-server-concurrency must be positive"),
    (["--session-server-port", "70000"], "--session-server-port must be a TCP port"),
    (["--custom-generate-function-path", "os.no_such_function"], "--custom-generate-function-path"),
]
if not torch.cuda.is_available():
    REFUSED.append((["--device", "cuda"], "--device cuda asked for, but no CUDA device is available"))
MEGATRON = megatron_available()[0]
if not MEGATRON:
    REFUSED.append((["--train-backend", "megatron"], "megatron-core is not installed"))


def _miles(capsys, argv):
    code = main(["run", *argv])
    captured = capsys.readouterr()
    return code, captured.err


@pytest.mark.parametrize("argv, message", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_run_and_dry_run_refuse_alike(argv, message, tmp_path, capsys):
    output = tmp_path / "out"
    full = [*run_inputs(), "--output-dir", str(output), *argv]
    run_code, run_err = _miles(capsys, full)
    dry_code, dry_err = _miles(capsys, [*full, "--dry-run"])
    assert run_code == 2 and message in run_err, run_err
    assert (dry_code, dry_err) == (run_code, run_err)
    assert not output.exists()  # refused before anything started


#: refused config values that need no plugin: a config built in Python with them
API_REFUSED = [(argv, message) for argv, message in REFUSED
               if "--plugins" not in argv and "--sglang-speculative-algorithm" not in argv
               and "--train-backend" not in argv and "--rollout-backend" not in argv]


@pytest.mark.parametrize("argv, message", API_REFUSED, ids=[" ".join(a) for a, _ in API_REFUSED])
def test_the_python_api_refuses_alike(argv, message, tmp_path, capsys):
    """``Run(config, manager)`` (the loop called directly) runs the same stage, same message."""
    from miles_host.loop import Run

    manager = MilesPluginManager()
    config, _ = resolve_run_config(run_inputs(), manager)
    code, err = _miles(capsys, [*run_inputs(), *argv, "--dry-run"])
    with pytest.raises((ValueError, FileNotFoundError)) as error:  # value checks: already when built
        Run(dataclasses.replace(config, user_set=None, output_dir=str(tmp_path / "out"), **_values_of(argv)), manager)
    assert code == 2 and err.strip() == f"miles: error: {error.value}"
    assert message in str(error.value)
    assert not (tmp_path / "out").exists()


def _values_of(argv: list[str]) -> dict:
    """The MilesConfig values of ``argv`` (flags of config fields only)."""
    fields = {f.name: f for f in dataclasses.fields(MilesConfig)}
    values, index = {}, 0
    while index < len(argv):
        field = fields[argv[index][2:].replace("-", "_")]
        if field.metadata.get("type") is None:
            values[field.name] = True
            index += 1
        else:
            values[field.name] = field.metadata["type"](argv[index + 1])
            index += 2
    return values


def test_selective_recompute_is_not_offered(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", *run_inputs(), "--recompute-granularity", "selective", "--dry-run"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'selective'" in capsys.readouterr().err


def test_accepted_settings_pass_dry_run(capsys):
    for argv in (["--plugins", "fp8", "--precision", "fp8"], ["--plugins", "fp8"], ["--plugins", "int4"],
                 ["--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "2"],
                 ["--enable-mtp-training", "--mtp-num-layers", "1"],
                 # what full recomputation does, as slime scripts spell it
                 ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
                 # --sequence-parallel reaches the backend that has tensor-parallel ranks
                 ["--train-backend", "megatron", "--tensor-model-parallel-size", "2",
                  "--actor-num-gpus-per-node", "2", "--sequence-parallel"]):
        if "megatron" in argv and not MEGATRON:
            continue
        code, err = _miles(capsys, [*run_inputs(), *argv, "--dry-run"])
        assert code == 0, (argv, err)


def test_plugin_sets_only_what_the_user_did_not():
    manager = MilesPluginManager()
    config, _ = resolve_run_config([*run_inputs(), "--plugins", "fp8"], manager)
    assert config.precision == "fp8" and "precision" not in config.user_set
    # a flag given with its default value counts as given
    config, _ = resolve_run_config([*run_inputs(), "--precision", "bf16"], MilesPluginManager())
    assert "precision" in config.user_set and "hf_checkpoint" in config.user_set
    assert "lr" not in config.user_set


def test_config_file_values_count_as_given(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("precision: bf16\n")
    code, err = _miles(capsys, [*run_inputs(), "--config", str(path), "--plugins", "fp8", "--dry-run"])
    assert code == 2 and "--precision bf16 was given" in err


def test_two_plugins_setting_one_field_differently_name_both():
    class SetsSeed:
        @staticmethod
        def miles_configure(config):
            config.seed = 7

    class SetsSeedToo:
        @staticmethod
        def miles_configure(config):
            config.seed = 8

    manager = MilesPluginManager()
    manager.discover(entry_points=[])
    manager.add_inline_plugin(SetsSeed(), "seven")
    manager.add_inline_plugin(SetsSeedToo(), "eight")
    with pytest.raises(ValueError, match="plugins 'seven' and 'eight' both set --seed"):
        resolve_run_config(run_inputs(), manager)


def test_record_validate_runs_only_for_the_selected_record():
    calls = []

    def refuse(config, registries):
        calls.append(config.precision)
        raise ValueError("--precision strict: refused by its record")

    class Plugin:
        @staticmethod
        def miles_register_precisions():
            return [records.Precision("strict", validate=refuse)]

    def manager():
        m = MilesPluginManager()
        m.discover(entry_points=[])
        m.add_inline_plugin(Plugin(), "strictplug")
        return m

    resolve_run_config(run_inputs(), manager())  # bf16 selected: the record's check does not run
    assert calls == []
    with pytest.raises(ValueError, match="refused by its record"):
        resolve_run_config([*run_inputs(), "--precision", "strict"], manager())
    assert calls == ["strict"]


def test_accepted_and_ignored_flags_warn_once(capsys, monkeypatch):
    monkeypatch.setattr(ignored_flags, "_warned", set())
    code, err = _miles(capsys, [*run_inputs(), "--model-name", "qwen3", "--num-gpus-per-node", "4", "--dry-run"])
    assert code == 0
    assert err.count("--model-name is accepted for slime compatibility and ignored") == 1
    assert err.count("--num-gpus-per-node is accepted for slime compatibility and ignored") == 1
    config = MilesConfig(hf_checkpoint=str(run_input_folder() / "model"), model_name="x")
    assert ignored_flags.warn_ignored_flags(config) == []  # once per process


def test_every_config_field_is_read_or_listed_as_ignored():
    """Each field is read as an attribute (``config.name``, ``getattr(config, "name")``) somewhere
    outside config.py, or is on the accepted-and-ignored list: no flag is silently dropped."""
    sources = [p for root in ("miles_host", "plugins") for p in (REPO / root).rglob("*.py")]
    text = "\n".join(p.read_text() for p in sources if p != REPO / "miles_host" / "config.py")
    # the --sglang-* / --router-* fields are read by name from the pinned SGLang list (forwarded to the servers,
    # honoured by the engine, or warned about): tests/host/test_sglang_args.py
    # (and SGLang's removed switches, mapped onto their current options by name: test_sglang_removed_switches.py)
    generic = {*SERVER_ARGS_BY_FIELD, *ROUTER_ARGS_BY_FIELD, *(server_field(s.name) for s in REMOVED_SERVER_SWITCHES)}
    unread = [
        name for name in MilesConfig.field_names()
        if name not in ACCEPTED_AND_IGNORED and name not in generic
        and not re.search(rf"\.{name}\b|[\"']{name}[\"']", text)
    ]
    assert unread == []
    # a backend that reads an ignored field names it in its TrainBackend.honoured_flags (no warning when it is
    # chosen); only that backend's plugin may read it
    manager = MilesPluginManager()
    manager.activate(["megatron"])
    honoured = {flag for backend in manager.registries.train_backends for flag in backend.honoured_flags}
    host = "\n".join(p.read_text() for p in (REPO / "miles_host").rglob("*.py") if p.name != "config.py")
    for name in ACCEPTED_AND_IGNORED:
        assert name in MilesConfig.field_names()
        reads = re.findall(rf"config\.{name}\b", host if name in honoured else text)
        assert reads == [], f"{name} is listed as ignored but is read"


def test_validate_is_the_stage_of_the_python_api(tmp_path):
    manager = MilesPluginManager()
    manager.activate()
    config = MilesConfig(hf_checkpoint=str(run_input_folder() / "model"),
                         prompt_data=str(run_input_folder() / "prompts.jsonl"), rm_type="exact",
                         n_samples_per_prompt=2)
    validate(config, manager.registries, manager.hook)
    with pytest.raises(ValueError, match="--sequence-parallel"):
        validate(dataclasses.replace(config, sequence_parallel=True), manager.registries, manager.hook)
