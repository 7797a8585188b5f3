"""``--sglang-*`` / ``--router-*``: every pinned SGLang option parses, slime's SGLANG_ARGS lines pass
``--dry-run``, the embedded engine honours its knobs and warns once about the rest, and
``--rollout-num-gpus-per-engine`` > 1 is refused for the engine backends."""

from __future__ import annotations

import json

import pytest

from miles_host.cli.args import build_run_parser
from miles_host.cli.main import main
from miles_host.config import MilesConfig
from miles_host.config_sglang import MILES_SETS, readable_int, router_field, server_field
from miles_host.plugin_manager import default_plugin_manager
from miles_host import sglang_embedded
from miles_host.sglang_args_data import ROUTER_ARGS, SERVER_ARGS, SGLANG_VERSION
from tests.run_inputs import run_inputs

#: a value to give each kind of option, and what argparse must make of it (an independent reading)
SAMPLES = {"str": ("x", "x"), "int": ("3", 3), "float": ("0.5", 0.5), "size": ("2k", 2000),
           "json": ('{"a": 1}', '{"a": 1}')}

#: SGLANG_ARGS arrays of slime's launch scripts (scripts/run-*.sh, scripts/low_precision/*.sh), as written
SLIME_SGLANG_ARGS = [
    "--rollout-num-gpus-per-engine 64 --sglang-mem-fraction-static 0.7 --sglang-ep-size 64 "
    "--sglang-enable-dp-attention --sglang-dp-size 8 --sglang-moe-dense-tp-size 1 --sglang-enable-dp-lm-head "
    "--sglang-moe-a2a-backend deepep --sglang-deepep-mode auto",  # run-deepseek-r1.sh
    "--rollout-num-gpus-per-engine 8 --sglang-mem-fraction-static 0.8 --sglang-enable-dp-attention --sglang-dp-size 8 "
    "--sglang-enable-dp-lm-head --sglang-moe-dense-tp-size 1 --sglang-speculative-algorithm EAGLE "
    "--sglang-speculative-num-steps 3 --sglang-speculative-eagle-topk 1 --sglang-speculative-num-draft-tokens 4 "
    "--sglang-cuda-graph-max-bs 64",  # run-glm4.7-30B-A3B.sh
    "--rollout-num-gpus-per-engine 32 --sglang-mem-fraction-static 0.7 --sglang-enable-dp-attention "
    "--sglang-dp-size 4 --sglang-ep-size 32 --sglang-enable-dp-lm-head --sglang-moe-dense-tp-size 1",  # glm4.7-355B
    "--rollout-num-gpus-per-engine 8 --sglang-mem-fraction-static 0.7 --sglang-ep-size 8 "
    "--sglang-cuda-graph-bs 1 2 4 8 " + " ".join(map(str, range(16, 257, 8))),  # low_precision/qwen3-235B-A22B-int4
    "--rollout-num-gpus-per-engine 8 --sglang-mem-fraction-static 0.6 --sglang-cuda-graph-bs 1 2 4 8 16 24 "
    "--sglang-expert-parallel-size 8",  # low_precision/run-qwen3-30b-a3b-fp8.sh
    "--rollout-num-gpus-per-engine 2 --sglang-mem-fraction-static 0.7",  # low_precision/run-qwen3-4b-fp8.sh
    "--rollout-num-gpus-per-engine 2",  # run-glm4-9B.sh
    "--rollout-num-gpus-per-engine 64 --sglang-mem-fraction-static 0.70 --sglang-enable-dp-attention "
    "--sglang-ep-size 64 --sglang-dp-size 64 --sglang-moe-dense-tp-size 1 --sglang-enable-dp-lm-head "
    "--sglang-moe-a2a-backend deepep --sglang-deepep-mode auto",  # run-glm5-744B-A40B.sh
    "--rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.7 --sglang-max-running-requests 256 "
    "--sglang-enable-deterministic-inference --sglang-attention-backend fa3 --sglang-kv-cache-dtype fp8_e4m3",
    "--rollout-num-gpus-per-engine 4 --sglang-mem-fraction-static 0.7 --sglang-router-ip 10.0.0.1 "
    "--sglang-router-port 3000 --router-policy cache_aware --router-balance-abs-threshold 4 "
    "--sglang-context-length 32k --sglang-chunked-prefill-size 4096",
]


@pytest.fixture(scope="module")
def parser():
    return build_run_parser(default_plugin_manager())[0]


def _argv_and_expected(arg, spelling: str):
    if arg.kind == "bool":
        return [spelling], True
    text, value = SAMPLES[arg.kind]
    if arg.nargs in ("+", "*"):
        return [spelling, text, text], [value, value]
    return [spelling, text], value


def test_every_pinned_server_and_router_option_parses_with_its_prefix(parser):
    """Each SGLang ServerArgs option (every spelling) is --sglang-<name>, each RouterArgs option --router-<name>,
    read as SGLang reads it; the pinned version is named in --help."""
    checked = 0
    host_declared = {"sglang_speculative_draft_model_path"}  # declared by the host without SGLang's alias
    for prefix, rows, field_of in (("--sglang-", SERVER_ARGS, server_field), ("--router-", ROUTER_ARGS, router_field)):
        for arg in rows:
            dest = field_of(arg.name)
            assert dest in MilesConfig.field_names()
            spellings = [arg.name] if dest in host_declared else [arg.name, *arg.aliases]
            for spelling in spellings:
                argv, expected = _argv_and_expected(arg, prefix + spelling)
                assert getattr(parser.parse_args(argv), dest) == expected, argv
                checked += 1
    assert checked > len(SERVER_ARGS) + len(ROUTER_ARGS)
    assert f"SGLang {SGLANG_VERSION} server" in parser.format_help()


def test_sizes_read_as_sglang_reads_them():
    assert [readable_int(t) for t in ("32768", "1k", "25.6k", "1Ki", "2Mi", "1M")] == [
        32768, 1000, 25600, 1024, 2 * 1024**2, 10**6]
    with pytest.raises(ValueError, match="no decimals"):
        readable_int("1.5Ki")


def _dry_run(capsys, *argv):
    code = main(["run", *argv, "--dry-run"])
    out = capsys.readouterr()
    return code, out


@pytest.mark.parametrize("line", SLIME_SGLANG_ARGS, ids=range(len(SLIME_SGLANG_ARGS)))
def test_slime_sglang_args_pass_dry_run_with_the_sglang_backend(line, capsys):
    code, out = _dry_run(capsys, *run_inputs(moe=True), "--rollout-backend", "sglang", "--sglang-server-command",
                         "sglang", *line.split())
    assert code == 0, out.err
    config = json.loads(out.out)["config"]
    aliases = {"sglang_expert_parallel_size": "sglang_ep_size"}
    flags = [token[2:].replace("-", "_") for token in line.split() if token.startswith("--")]
    given = set(config["user_set"]) | set(config["plugin_args"])
    assert {aliases.get(name, name) for name in flags} <= given


def test_slime_values_reach_the_config(capsys):
    code, out = _dry_run(capsys, *run_inputs(moe=True), "--rollout-backend", "sglang", "--sglang-server-command",
                         "sglang", *SLIME_SGLANG_ARGS[0].split(), "--sglang-cuda-graph-bs", "1", "2", "4", "8",
                         "--sglang-context-length", "32k")
    assert code == 0, out.err
    config = json.loads(out.out)["config"]
    assert (config["rollout_num_gpus_per_engine"], config["sglang_ep_size"], config["sglang_dp_size"]) == (64, 64, 8)
    assert config["sglang_enable_dp_attention"] is True and config["sglang_moe_a2a_backend"] == "deepep"
    assert config["sglang_cuda_graph_bs"] == [1, 2, 4, 8] and config["sglang_context_length"] == 32000
    assert config["sglang_mem_fraction_static"] == 0.7 and config["router_log_level"] == "warn"  # slime's default


def test_slime_sglang_args_with_the_embedded_engine_warn_once_naming_the_ignored(capsys, monkeypatch):
    monkeypatch.setattr(sglang_embedded, "_warned", set())
    line = SLIME_SGLANG_ARGS[1].split()[2:]  # without --rollout-num-gpus-per-engine 8
    code, out = _dry_run(capsys, *run_inputs(moe=True), *line, "--router-policy", "round_robin")
    assert code == 0, out.err
    warnings = [w for w in out.err.splitlines() if "no meaning for the embedded engine" in w]
    assert len(warnings) == 1
    named = set(warnings[0].split("embedded engine: ")[1].split(" (")[0].split())
    assert named == {"--sglang-enable-dp-attention", "--sglang-dp-size", "--sglang-enable-dp-lm-head",
                     "--sglang-moe-dense-tp-size", "--router-policy"}  # --sglang-cuda-graph-max-bs: honoured
    config = MilesConfig(**{"sglang_dp_size": 8, "router_policy": "round_robin"})
    assert sglang_embedded.warn_unhonoured_flags(config) == []  # once per process


def test_rollout_num_gpus_per_engine_above_one_is_refused_for_the_engine_backends(capsys):
    for backend in ("embedded", "process"):
        code, out = _dry_run(capsys, *run_inputs(), "--rollout-backend", backend, "--rollout-num-gpus-per-engine", "2")
        assert code == 2
        assert "--rollout-num-gpus-per-engine 2: the embedded engine" in out.err
        assert "use --rollout-backend sglang" in out.err


def test_tensor_parallel_servers_need_real_sglang_and_whole_engines(capsys):
    common = [*run_inputs(), "--rollout-backend", "sglang", "--rollout-num-gpus-per-engine", "2"]
    code, out = _dry_run(capsys, *common, "--sglang-server-command", "miles")
    assert code == 2 and "miles serve" in out.err and "install SGLang" in out.err
    code, out = _dry_run(capsys, *common, "--sglang-server-command", "sglang", "--rollout-num-gpus", "3")
    assert code == 2 and "--rollout-num-gpus 3 is not a multiple of --rollout-num-gpus-per-engine 2" in out.err
    code, out = _dry_run(capsys, *common, "--sglang-server-command", "sglang", "--rollout-num-gpus", "4")
    assert code == 0, out.err


@pytest.mark.parametrize("name", sorted(MILES_SETS))
def test_options_miles_sets_itself_are_refused_naming_the_miles_flag(name, parser):
    arg = next(a for a in SERVER_ARGS if a.name == name)
    argv, _ = _argv_and_expected(arg, "--sglang-" + name)
    values = {server_field(name): getattr(parser.parse_args(argv), server_field(name))}
    with pytest.raises(ValueError, match=f"--sglang-{name}: miles sets SGLang's --{name} itself"):
        MilesConfig(**values)


def test_sglang_config_is_refused_with_the_sglang_backend(capsys):
    code, out = _dry_run(capsys, *run_inputs(), "--rollout-backend", "sglang", "--sglang-config", "groups.yaml")
    assert code == 2 and "--sglang-config" in out.err
