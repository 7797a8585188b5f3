"""``miles run``'s parser: config fields as slime-spelled flags, plus plugin flags.

Flags override values from ``--config file.yaml``. A plugin's flags are added for
every importable plugin, so a script parses whether or not the plugin is active;
setting a flag of an inactive plugin is an error at resolution, never ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import re
from pathlib import Path
from typing import Any, Sequence

import yaml

from miles_host.cli.backend_choice import choose_backends
from miles_host.config import NON_FLAG_FIELDS, MilesConfig
from miles_host.config_fields import flag_name
from miles_host.distributed.placement import prepare as prepare_processes
from miles_host.distributed.placement import wants_distributed
from miles_host.plugin_manager import MilesPluginManager, PluginError, parse_plugin_names
from miles_host.validation import configure_with_plugins, validate


class UsageError(ValueError):
    """A command-line mistake; the CLI exits with code 2."""


def add_plugin_selection_arguments(parser: argparse.ArgumentParser) -> None:
    """``--plugins fp8,r3`` and pytest's ``-p no:NAME``."""
    parser.add_argument(
        "--plugins",
        action="append",
        default=[],
        help="feature plugins to activate, comma separated (also MILES_PLUGINS)",
    )
    parser.add_argument(
        "-p",
        dest="plugin_switches",
        action="append",
        default=[],
        metavar="no:NAME",
        help="-p no:NAME disables a plugin (built-ins included); -p NAME activates one",
    )


def build_run_parser(manager: MilesPluginManager) -> tuple[argparse.ArgumentParser, dict[str, str]]:
    """The full parser and ``{dest: plugin name}`` for plugin-owned flags."""
    parser = argparse.ArgumentParser(
        prog="miles run",
        description="Run RL post-training (rollout, reward, advantages, train, weight sync).",
        allow_abbrev=False,
    )
    # "--lr -1e-4" is a value (refused by validation), not an unknown option: Python 3.13's rule,
    # where older versions read only -1 and -1.5 as numbers
    parser._negative_number_matcher = re.compile(r"-\.?\d")
    add_plugin_selection_arguments(parser)
    parser.add_argument("--config", help="YAML file of flag values; command-line flags override it")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config as JSON and exit")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(MilesConfig):
        if f.name in NON_FLAG_FIELDS:
            continue
        meta = f.metadata
        group_name = meta.get("group") or "general"
        group = groups.get(group_name) or parser.add_argument_group(group_name)
        groups[group_name] = group
        names = [flag_name(f.name), *meta.get("aliases", ())]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if meta.get("type") is None:
            group.add_argument(*names, dest=f.name, action="store_true", default=default, help=meta["help"])
        else:
            kwargs: dict[str, Any] = {"type": meta["type"], "default": default, "help": meta["help"]}
            if meta.get("nargs"):
                kwargs["nargs"] = meta["nargs"]
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
            group.add_argument(*names, dest=f.name, **kwargs)
    plugin_dests: dict[str, str] = {}
    for name, info in manager.plugins.items():
        function = getattr(info.module, "miles_add_arguments", None) if info.module else None
        if function is None:
            continue
        before = {action.dest for action in parser._actions}
        try:
            function(parser=parser)
        except argparse.ArgumentError as error:
            raise PluginError(
                f"plugin {name!r} ({info.distribution}) adds a flag that clashes with another: {error}"
            ) from error
        for action in parser._actions:
            if action.dest not in before:
                plugin_dests[action.dest] = name
    return parser, plugin_dests


def load_config_file(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Read a YAML (or JSON) file of flag values keyed by dest or flag spelling."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--config file {path} does not exist")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as error:
        raise UsageError(f"--config file {path} is not valid YAML: {error}") from error
    if not isinstance(data, dict):
        raise UsageError(f"--config file {path} must hold a mapping of flag: value")
    dests = {action.dest for action in parser._actions}
    values = {}
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in dests:
            close = difflib.get_close_matches(dest, dests, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UsageError(f"--config file {path}: unknown key {key!r}{hint}")
        values[dest] = value
    return values


def given_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The dests ``argv`` names (a flag given with its default value counts too):
    ``argv`` parsed again with every default suppressed."""
    saved_actions = {action: action.default for action in parser._actions}
    saved_defaults = dict(parser._defaults)
    try:
        for action in parser._actions:
            action.default = argparse.SUPPRESS
        parser._defaults.clear()
        return set(vars(parser.parse_args(list(argv))))
    finally:
        for action, default in saved_actions.items():
            action.default = default
        parser._defaults.update(saved_defaults)


def resolve_run_config(
    argv: Sequence[str], manager: MilesPluginManager
) -> tuple[MilesConfig, argparse.Namespace]:
    """Parse ``argv``, activate plugins and return the configured, validated config."""
    pre = argparse.ArgumentParser(add_help=False)
    add_plugin_selection_arguments(pre)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if not manager.discovered:
        manager.discover()
    parser, plugin_dests = build_run_parser(manager)
    from miles_host.quickstart_preset import quickstart_defaults, wants_quickstart

    if wants_quickstart(list(argv)):
        parser.set_defaults(**quickstart_defaults())
    from_file = load_config_file(known.config, parser) if known.config else {}
    parser.set_defaults(**from_file)
    args = parser.parse_args(list(argv))
    given = given_dests(parser, argv) | set(from_file)
    choose_backends(args, given, set(manager.plugins))  # slime scripts: Megatron training, SGLang engines
    switches = parse_plugin_names(args.plugin_switches)
    disabled = [s[3:] for s in switches if s.startswith("no:")]
    selected = [
        *parse_plugin_names([os.environ.get("MILES_PLUGINS", "")]),
        *parse_plugin_names(args.plugins),
        *[s for s in switches if not s.startswith("no:")],
    ]
    active = manager.activate(selected=selected, disabled=disabled, args=args)
    for dest, plugin in plugin_dests.items():
        if plugin not in active and dest in given:
            raise UsageError(
                f"{flag_name(dest)} belongs to plugin {plugin!r}, which is not active; "
                f"add --plugins {plugin}"
            )
    core = {name: getattr(args, name) for name in MilesConfig.field_names()}
    plugin_args = {dest: getattr(args, dest) for dest in plugin_dests}
    feature_plugins = [name for name in active if name in manager.feature_plugin_names()]
    user_set = sorted(name for name in core if name in given)
    config = MilesConfig(**core, plugins=feature_plugins, plugin_args=plugin_args, user_set=user_set)
    configure_with_plugins(config, manager)
    if wants_distributed(config, manager.registries):
        prepare_processes(config, manager.registries)  # the multi-process backends the run uses, validated as such
    validate(config, manager.registries, manager.hook)  # builds every registry: duplicates fail here too
    manager.hook.miles_process_start(config=config)
    return config, args


def config_report(config: MilesConfig, manager: MilesPluginManager) -> str:
    """The JSON that ``miles run --dry-run`` prints."""
    report = {
        "config": config.to_dict(),
        "active_plugins": [
            {"name": n, "distribution": manager.plugins[n].distribution, "version": manager.plugins[n].version}
            for n in manager.active_names()
        ],
    }
    return json.dumps(report, indent=2, sort_keys=True, default=str)
