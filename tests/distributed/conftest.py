"""Helpers of the multi-process tests: the tiny task of tests/loop, and a
``miles run`` that goes through the process launcher."""

from __future__ import annotations

import pytest

from tests.loop.conftest import base_args, build_tiny_policy, read_metrics, write_addition_data  # noqa: F401


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_dist")
    return build_tiny_policy(root / "model"), write_addition_data(root / "data.jsonl", 64)


def resolve(argv: list[str], **overrides):
    """(config, manager) as ``miles run`` resolves them, plus field / plugin-flag overrides."""
    from miles_host.cli.args import resolve_run_config
    from miles_host.plugin_manager import MilesPluginManager

    manager = MilesPluginManager()
    config, _ = resolve_run_config(argv[1:] if argv[:1] == ["run"] else argv, manager)
    for key, value in overrides.items():
        if key in type(config).field_names():
            setattr(config, key, value)
        else:
            config.plugin_args[key] = value
    return config, manager


def run_one_process(argv: list[str]) -> int:
    from miles_host.distributed.launcher import run_training

    config, manager = resolve(argv)
    return run_training(config, manager)


def run_launched(argv: list[str], **overrides) -> int:
    from miles_host.distributed.launcher import run_distributed

    config, manager = resolve(argv, **overrides)
    return run_distributed(config, manager)


@pytest.fixture
def signal_reward(tmp_path, monkeypatch):
    """``--custom-rm-path`` of a reward with variance inside a group (the random tiny
    policy never adds correctly, so exact-match rewards are all 0 and nothing trains)."""
    import sys
    import textwrap

    (tmp_path / "dist_rewards.py").write_text(textwrap.dedent(
        """
        def odd_first_char(sample, config):
            return float(sample.response[:1] in ("1", "3", "5", "7", "9", "+"))
        """
    ))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("dist_rewards", None)
    return ["--custom-rm-path", "dist_rewards.odd_first_char"]


@pytest.fixture
def fault_plugin(tmp_path, monkeypatch):
    """The ``faults`` test plugin (tests/fault_plugin), installed as a distribution with a
    ``miles.plugins`` entry point that the driver and the spawned workers discover."""
    from pathlib import Path

    info = tmp_path / "site" / "miles_test_faults-0.0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: miles-test-faults\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text("[miles.plugins]\nfaults = miles_test_faults\n")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "fault_plugin"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return ["--plugins", "faults"]
