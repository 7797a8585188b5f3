"""Test-suite options shared by ``tests/`` and ``plugins/``.

Tests marked ``slow`` (whole runs in subprocesses, long training runs) are skipped unless
``--run-slow`` is given, so the default suite (``bash scripts/test.sh``, what CI runs) stays
within its time budget; ``bash scripts/test.sh --run-slow`` runs everything.

After each test marked ``gpu`` the garbage (engines in reference cycles, their CUDA graphs and
KV caches) is collected and the allocator's cache emptied: an engine sizes its KV cache from the
free GPU memory, so one left behind by an earlier test starves the next (seen as failures of
engine tests that pass alone)."""

from __future__ import annotations

import gc

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="also run the tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow (bash scripts/test.sh --run-slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _free_gpu_memory_after_gpu_tests(request: pytest.FixtureRequest):
    yield
    if "gpu" not in request.keywords:
        return
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
