"""Test-suite options shared by ``tests/`` and ``plugins/``.

Tests marked ``slow`` (whole runs in subprocesses, long training runs) are skipped unless
``--run-slow`` is given, so the default suite (``bash scripts/test.sh``, what CI runs) stays
within its time budget; ``bash scripts/test.sh --run-slow`` runs everything."""

from __future__ import annotations

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
