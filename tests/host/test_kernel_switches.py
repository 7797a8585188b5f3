"""Kernel switches are config values: flags of ``miles run``, in config.json, set in every
process of the run from its config; no production code reads a MILES_* environment variable."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from miles_host.cli.args import resolve_run_config
from miles_host.cli.main import main
from miles_host.distributed.comm import rebuild_manager
from miles_host.kernels import split_k, switches
from miles_host.plugin_manager import MilesPluginManager
from tests.kernel_switches import use_switches
from tests.run_inputs import run_inputs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_switches(monkeypatch):
    """Each test starts from the defaults and leaves them behind."""
    monkeypatch.setattr(switches, "VALUES", {})


def test_plugin_switches_are_flags_set_in_the_driver_and_in_workers():
    from miles_fp8 import gemm, kernel_switches as fp8
    from miles_int4 import kernels, kernel_switches as int4

    argv = [*run_inputs(), "--plugins", "fp8", "--fp8-gemm", "reference", "--fp8-small-m", "16",
            "--split-k-reduce", "torch"]
    config, _ = resolve_run_config(argv, MilesPluginManager())
    assert config.plugin_args["fp8_gemm"] == "reference" and config.split_k_reduce == "torch"
    assert switches.value(fp8.GEMM) == "reference" and gemm.small_m_limit() == 16
    assert not split_k.reduce_in_kernel()
    # a worker process: the same values from the driver's config once its manager is rebuilt
    switches.VALUES.clear()
    assert switches.value(fp8.GEMM) == "auto" and split_k.reduce_in_kernel()
    rebuild_manager(config)
    assert switches.value(fp8.GEMM) == "reference" and gemm.small_m_limit() == 16
    assert not split_k.reduce_in_kernel()
    assert switches.value(int4.TILE_ROWS) == 1 and kernels.halves_tile_rows(256) == 128  # int4 not active


def test_switches_land_in_the_dry_run_config(capsys):
    code = main(["run", *run_inputs(), "--plugins", "int4", "--int4-gemv", "0", "--int4-cuda-layout", "tinygemm",
                 "--dry-run"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["config"]["plugin_args"]["int4_gemv"] == 0
    assert report["config"]["plugin_args"]["int4_cuda_layout"] == "tinygemm"
    assert report["config"]["split_k_reduce"] == "kernel"


def test_bad_switch_values_are_refused_naming_the_flag(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        main(["run", *run_inputs(), "--plugins", "fp8", "--fp8-gemm", "cublas", "--dry-run"])
    assert "--fp8-gemm: invalid choice: 'cublas'" in capsys.readouterr().err
    code = main(["run", *run_inputs(), "--plugins", "fp8", "--fp8-small-m", "-1", "--dry-run"])
    assert code == 2 and "--fp8-small-m -1: give a count >= 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown kernel switch 'fp8_gem'"):
        use_switches(monkeypatch, fp8_gem="triton")


def test_switched_restores_the_previous_value():
    from miles_int4 import decode_gemm

    with switches.switched(int4_gemv=0):
        assert not decode_gemm.gemv_enabled()
    assert decode_gemm.gemv_enabled()


def test_no_production_code_reads_a_miles_environment_variable():
    """Choices of a run are config fields; only MILES_PLUGINS (which plugins to load) is read."""
    reads = re.compile(r"""(?:environ(?:\.get)?\(|environ\[|getenv\()\s*["'](MILES_\w+)""")
    found = {}
    for root in ("miles_host", "plugins"):
        for path in (REPO / root).rglob("*.py"):
            for name in reads.findall(path.read_text()):
                found.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert set(found) <= {"MILES_PLUGINS"}, found


def test_every_host_switch_is_declared_from_its_record_and_is_a_config_flag():
    """Each record of ``HOST_SWITCHES`` is declared from that record and is a ``kernels``-group config
    field with the record's default and choices."""
    import dataclasses

    from miles_host.config import TrainArgs
    from miles_host.config_kernels import HOST_SWITCHES

    fields = {f.name: f for f in dataclasses.fields(TrainArgs)}
    switches.host_switches()
    for name, spec in HOST_SWITCHES.items():
        switch = switches.declared(name)
        assert (switch.default, switch.choices, switch.help) == (spec.default, spec.choices, spec.help), name
        assert fields[name].default == spec.default and fields[name].metadata["group"] == "kernels", name
        choices = fields[name].metadata["choices"]
        assert (tuple(choices) if choices is not None else None) == spec.choices, name


def test_process_start_sets_every_host_switch_from_the_config():
    """The built-in plugin's process start applies every record of ``HOST_SWITCHES`` (a switch added
    there cannot be a flag the run accepts and never sets)."""
    import dataclasses

    from miles_host.builtin.precision import miles_process_start
    from miles_host.config import TrainArgs
    from miles_host.config_kernels import HOST_SWITCHES

    chosen = {name: (spec.choices[-1] if spec.choices is not None else spec.default + 1)
              for name, spec in HOST_SWITCHES.items()}
    miles_process_start(dataclasses.replace(TrainArgs(), **chosen))
    assert {name: switches.value(switches.declared(name)) for name in HOST_SWITCHES} == chosen
