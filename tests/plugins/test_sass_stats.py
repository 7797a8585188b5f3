"""``scripts/sass_stats.py``: a repository kernel compiled for sm_90 here, its loop counted in SASS."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def _script():
    path = Path(__file__).resolve().parents[2] / "scripts" / "sass_stats.py"
    spec = importlib.util.spec_from_file_location("sass_stats", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sass_stats"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_the_int4_gemv_loop_is_counted(capsys):
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra installs it)")
    sass_stats = _script()
    preset = sass_stats.presets()["int4-gemv"]
    try:
        cubin = sass_stats.compile_cubin(preset)
    except FileNotFoundError as error:  # a triton build without the NVIDIA toolchain
        pytest.skip(f"cannot compile for sm_90 here: {error}")
    assert sass_stats.resources(cubin)["REG"] > 0
    (start, end, opcodes), *_ = sass_stats.loops(sass_stats._cuobjdump(cubin, "-sass"))
    # the word-pair dequantization and the fp32 FMAs of the inline PTX are in the group loop
    assert start < end and opcodes["LOP3"] > 0 and opcodes["FFMA"] > 0 and opcodes["HMUL2"] > 0
    assert sass_stats.main(["int4-gemv", "--warps", "8"]) == 0
    assert "per weight/element" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        sass_stats.main(["no-such-kernel"])
