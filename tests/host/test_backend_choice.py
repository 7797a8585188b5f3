"""The backends a slime script asks for without naming them: Megatron for model parallelism,
SGLang for ``--rollout-num-gpus-per-engine N > 1``; a backend the user named is kept."""

from __future__ import annotations

import argparse
import json

import pytest

from miles_host.cli.backend_choice import IMPLIED_BACKENDS, SGLANG_ROLLOUT, choose_backend, choose_backends
from miles_host.cli.main import main
from tests.loop.conftest import build_tiny_policy, write_addition_data


def _args(**overrides) -> argparse.Namespace:
    values = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                  context_parallel_size=1, sequence_parallel=False, train_backend="native",
                  rollout_num_gpus_per_engine=1, rollout_backend="embedded")
    return argparse.Namespace(**{**values, **overrides})


def test_every_choice_is_a_record_of_its_own_field():
    assert len({choice.dest for choice in IMPLIED_BACKENDS}) == len(IMPLIED_BACKENDS)
    assert SGLANG_ROLLOUT in IMPLIED_BACKENDS


def test_multi_gpu_engines_pick_sglang_with_one_note(capsys):
    args = _args(rollout_num_gpus_per_engine=4)
    assert choose_backends(args, set(), installed={"sglang", "megatron"}) == {"rollout_backend": "sglang"}
    assert args.rollout_backend == "sglang" and args.train_backend == "native"
    err = capsys.readouterr().err
    assert err.count("miles: note:") == 1
    assert "(--rollout-num-gpus-per-engine 4) roll out with --rollout-backend sglang (plugin miles-sglang)" in err


def test_both_choices_at_once(capsys):
    args = _args(rollout_num_gpus_per_engine=2, tensor_model_parallel_size=2)
    assert choose_backends(args, set(), {"sglang", "megatron"}) == {"train_backend": "megatron",
                                                                     "rollout_backend": "sglang"}
    assert capsys.readouterr().err.count("miles: note:") == 2


@pytest.mark.parametrize("gpus", [1, None])
def test_one_gpu_engines_keep_the_default(gpus):
    args = _args(rollout_num_gpus_per_engine=gpus)
    assert choose_backend(SGLANG_ROLLOUT, args, set(), {"sglang"}) is None
    assert args.rollout_backend == "embedded"


def test_a_named_backend_is_kept():
    args = _args(rollout_num_gpus_per_engine=2)
    assert choose_backend(SGLANG_ROLLOUT, args, {"rollout_backend"}, {"sglang"}) is None
    assert args.rollout_backend == "embedded"


def test_without_the_plugin_the_error_says_what_to_install():
    with pytest.raises(ValueError, match=r"--rollout-num-gpus-per-engine 2: tensor-parallel rollout engines roll "
                                         r"out with --rollout-backend sglang, whose plugin is not installed "
                                         r"\(pip install miles-sglang\); or give --rollout-num-gpus-per-engine 1"):
        choose_backend(SGLANG_ROLLOUT, _args(rollout_num_gpus_per_engine=2), set(), installed={"megatron"})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("backend_choice")
    return build_tiny_policy(root / "model"), write_addition_data(root / "data.jsonl", 4)


def _dry_run(tiny, capsys, *extra: str) -> tuple[int, str, str]:
    model, data = tiny
    try:
        code = main(["run", "--hf-checkpoint", str(model), "--prompt-data", str(data), "--label-key", "label",
                     "--rm-type", "exact", *extra, "--dry-run"])
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_dry_run_picks_sglang_engines(tiny, capsys, monkeypatch):
    """Where SGLang is installed (the servers launched are real SGLang, tensor parallel 2)."""
    monkeypatch.setattr("miles_sglang.launcher.server_kind", lambda config: "sglang")
    code, out, err = _dry_run(tiny, capsys, "--rollout-num-gpus-per-engine", "2")
    assert code == 0, err[-2000:]
    config = json.loads(out)["config"]
    assert config["rollout_backend"] == "sglang" and config["weight_sync"] == "sglang_tensor"
    assert "chosen because no --rollout-backend was given" in err


def test_dry_run_without_sglang_says_miles_serve_is_one_gpu(tiny, capsys, monkeypatch):
    monkeypatch.setattr("miles_sglang.launcher.server_kind", lambda config: "miles")
    code, _, err = _dry_run(tiny, capsys, "--rollout-num-gpus-per-engine", "2")
    assert code == 2 and "install SGLang for tensor-parallel servers, or use 1" in err


@pytest.mark.parametrize("backend", ["embedded", "process"])
def test_the_embedded_engine_asked_for_refuses_multi_gpu_engines(tiny, capsys, backend):
    code, _, err = _dry_run(tiny, capsys, "--rollout-num-gpus-per-engine", "2", "--rollout-backend", backend)
    assert code == 2
    assert f"--rollout-num-gpus-per-engine 2: the embedded engine (--rollout-backend {backend}) runs on one GPU" in err
    assert "use --rollout-backend sglang" in err
