"""Triton kernels on the CPU, under Triton's interpreter, in a process of their own.

``@triton.jit`` picks the interpreter when a function is *defined*, Triton's own
``tl.max`` / ``tl.sum`` included (defined at ``import triton``), and most test
sessions import triton early (transformers -> torch._dynamo). So the CPU tests
of a kernel live in a file pytest does not collect by itself
(``interpreted_*.py``); :func:`run_interpreted` runs that file in a fresh Python
with ``TRITON_INTERPRET=1`` from the start, and the file's tests take their
kernel modules from :func:`interpreted_module`.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def interpreted_module(name: str) -> ModuleType:
    """Import kernel module ``name``; skip unless this process runs under the interpreter."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton-interpreter tests: run through run_interpreted (TRITON_INTERPRET=1 from the start)")
    pytest.importorskip("triton")
    return importlib.import_module(name)


def run_interpreted(path: Path, request: pytest.FixtureRequest, timeout: int = 900) -> None:
    """Run the CPU tests of ``path`` in a fresh interpreter process; fail with its report when they fail.

    GPU tests are deselected there; ``not slow`` in this session's ``-m`` carries over.
    """
    pytest.importorskip("triton")
    marks = "not gpu"
    if "not slow" in (request.config.getoption("markexpr") or ""):
        marks += " and not slow"
    env = dict(os.environ, TRITON_INTERPRET="1")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marks, str(path)]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    report = (result.stdout + result.stderr).strip()
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{report[-8000:]}"
    print(report.splitlines()[-1])
