"""Fixtures: throwaway plugin distributions, installed for real with pip.

The packages are built and installed into a temporary ``--target`` directory;
``miles`` runs in a subprocess with that directory on ``PYTHONPATH``, so plugin
discovery goes through real ``.dist-info`` entry-point metadata.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PLUGIN_PACKAGES = {
    # name: (distribution, host requirement, module source)
    "goodplug": (
        "miles-test-goodplug",
        "miles-host>=0.1,<1",
        '''
        from miles_host.records import RewardFunction

        def _length_reward(sample, config=None):
            return float(len(sample.response))

        def miles_register_reward_functions():
            return [RewardFunction("response_length", "reward = response length", fn=_length_reward)]

        def miles_add_arguments(parser):
            parser.add_argument("--goodplug-level", type=int, default=1)

        def miles_configure(config):
            config.plugin_args["goodplug_configured"] = True
        ''',
    ),
    "brokenplug": ("miles-test-brokenplug", "miles-host>=0.1", "import this_module_does_not_exist_anywhere\n"),
    "oldplug": ("miles-test-oldplug", "miles-host<0.1", "def miles_configure(config):\n    pass\n"),
    "typoplug": (
        "miles-test-typoplug",
        "miles-host>=0.1",
        "def miles_register_reward_fuctions():\n    return []\n",
    ),
    "dupreward": (
        "miles-test-dupreward",
        "miles-host>=0.1",
        '''
        from miles_host.records import RewardFunction

        def miles_register_reward_functions():
            return [RewardFunction("math", "clashes with the built-in", fn=lambda s, c=None: 0.0)]
        ''',
    ),
    "dupname_a": ("miles-test-dupname-a", "miles-host>=0.1", "pass\n"),
    "dupname_b": ("miles-test-dupname-b", "miles-host>=0.1", "pass\n"),
}
#: entry-point name under which each package registers (dupname_a/b collide on purpose)
ENTRY_NAMES = {"dupname_a": "dupname", "dupname_b": "dupname"}


def _write_package(root: Path, module: str, distribution: str, requirement: str, source: str) -> Path:
    package_dir = root / module
    (package_dir / f"miles_test_{module}").mkdir(parents=True)
    (package_dir / f"miles_test_{module}" / "__init__.py").write_text(textwrap.dedent(source))
    entry = ENTRY_NAMES.get(module, module)
    (package_dir / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""
            [build-system]
            requires = ["setuptools>=64"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "{distribution}"
            version = "0.0.1"
            dependencies = ["{requirement}"]

            [project.entry-points."miles.plugins"]
            {entry} = "miles_test_{module}"

            [tool.setuptools]
            packages = ["miles_test_{module}"]
            """
        )
    )
    return package_dir


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory) -> Path:
    """A directory holding the throwaway plugins, installed by pip."""
    root = tmp_path_factory.mktemp("plugin_src")
    target = tmp_path_factory.mktemp("plugin_site")
    dirs = [
        _write_package(root, module, dist, req, src) for module, (dist, req, src) in PLUGIN_PACKAGES.items()
    ]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--no-compile", "--target", str(target), *map(str, dirs)],
        check=True,
        capture_output=True,
    )
    return target


@pytest.fixture
def run_miles(plugin_site):
    """Run ``miles`` in a subprocess that sees the throwaway plugins."""

    def run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
        environment = dict(os.environ)
        environment["PYTHONPATH"] = os.pathsep.join(
            [str(plugin_site), *filter(None, [environment.get("PYTHONPATH")])]
        )
        environment.pop("MILES_PLUGINS", None)
        environment.update(env or {})
        return subprocess.run(
            [sys.executable, "-m", "miles_host.cli.main", *argv],
            capture_output=True,
            text=True,
            env=environment,
            timeout=120,
        )

    return run


def dry_run_config(result: subprocess.CompletedProcess) -> dict:
    """The config JSON printed by ``miles run --dry-run``."""
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)
