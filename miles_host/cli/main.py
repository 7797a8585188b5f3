"""The ``miles`` command: ``run`` (default), ``plugins``, ``convert``, ``dashboard`` and plugin commands."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any, Sequence

from miles_host import __version__
from miles_host.cli.args import UsageError, config_report, resolve_run_config
from miles_host.health import RunStopped
from miles_host.plugin_manager import MilesPluginManager, PluginError
from miles_host.records import Command
from miles_host.registry import DuplicateNameError, Registry
from miles_host.run_control import OutputWriteError, Stopped

HOST_COMMANDS = ("run", "plugins", "convert", "dashboard")


def _error(message: str, code: int) -> int:
    print(f"miles: error: {message}", file=sys.stderr)
    return code


def cmd_run(argv: Sequence[str]) -> int:
    """``miles run [flags]``: resolve the config, then run the RL loop."""
    manager = MilesPluginManager()
    config, args = resolve_run_config(argv, manager)
    if args.dry_run:
        print(config_report(config, manager))
        return 0
    from miles_host.distributed.launcher import run_training  # heavy imports only when running

    return run_training(config, manager)


def cmd_plugins(argv: Sequence[str]) -> int:
    """``miles plugins [--json]``: list installed plugins and their state."""
    parser = argparse.ArgumentParser(prog="miles plugins", description="List installed miles plugins.")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--plugins", action="append", default=[], help="also activate these (to check them)")
    args = parser.parse_args(list(argv))
    manager = MilesPluginManager()
    manager.discover()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            manager.activate(selected=args.plugins)
        except PluginError as error:
            print(f"miles: warning: {error}", file=sys.stderr)
    rows = [info.to_dict() for info in manager.plugins.values()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"miles-host {__version__}")
    width = max(len(r["name"]) for r in rows)
    for row in rows:
        state = row["status"] + (f" ({row['error']})" if row["error"] else "")
        print(f"  {row['name']:<{width}}  {row['distribution']} {row['version']}  {state}")
        print(f"  {'':<{width}}  hooks: {', '.join(row['hooks']) or '-'}")
    return 0


def installed_records(manager: MilesPluginManager, hook_name: str, kind: str, reserved: Sequence[str] = ()) -> dict[str, Any]:
    """Name -> record of ``hook_name`` over every importable plugin (active or not: a command
    or converter is offered before any ``--plugins``), through a :class:`Registry`, so a
    duplicate name or a record without its callable is refused as at run registration."""
    registry = Registry(kind)
    for plugin, records in manager.call_each(hook_name).items():
        info = manager.plugins.get(plugin)
        distribution = info.distribution if info else plugin
        for record in records or ():
            if record.name in reserved:
                raise PluginError(f"plugin {plugin!r} ({distribution}) registers a {kind} {record.name!r} that already exists")
            try:
                registry.add(record, plugin, distribution)
            except (DuplicateNameError, TypeError) as error:
                raise PluginError(str(error)) from error
    return {record.name: record for record in registry}


def checkpoint_converters(manager: MilesPluginManager) -> dict[str, Any]:
    """``--to`` formats offered by every importable plugin (active or not)."""
    return installed_records(manager, "miles_register_checkpoint_converters", "checkpoint converter")


def cmd_convert(argv: Sequence[str]) -> int:
    """``miles convert --to FORMAT SRC DST [format flags]``: convert an HF checkpoint."""
    manager = MilesPluginManager()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager.discover()
    converters = checkpoint_converters(manager)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--to")
    known, _ = pre.parse_known_args(list(argv))
    parser = argparse.ArgumentParser(prog="miles convert", description="Convert an HF checkpoint to another format.")
    parser.add_argument("--to", required=True,
                        help="target format (from installed plugins: " + (", ".join(sorted(converters)) or "none") + ")")
    parser.add_argument("src", help="HF checkpoint directory to read")
    parser.add_argument("dst", help="directory to write")
    if known.to in converters and converters[known.to].add_arguments is not None:
        converters[known.to].add_arguments(parser)
    args = parser.parse_args(list(argv))
    if args.to not in converters:
        installed = ", ".join(sorted(converters)) or "none: install miles-fp8 or miles-int4"
        raise UsageError(f"unknown checkpoint format {args.to!r}; formats: {installed}")
    converters[args.to].convert(args.src, args.dst, args)
    print(f"miles: wrote {args.to} checkpoint to {args.dst}")
    return 0


def plugin_commands(manager: MilesPluginManager) -> dict[str, Command]:
    """Sub-commands offered by every importable plugin (active or not)."""
    return installed_records(manager, "miles_register_commands", "command", reserved=HOST_COMMANDS)


def cmd_plugin_command(command: Command, argv: Sequence[str]) -> int:
    """Run a plugin-provided sub-command."""
    parser = argparse.ArgumentParser(prog=f"miles {command.name}", description=command.description)
    if command.add_arguments is not None:
        command.add_arguments(parser)
    args = parser.parse_args(list(argv))
    return int(command.run(args) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``miles`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        print(f"miles-host {__version__}")
        return 0
    name = argv[0] if argv and not argv[0].startswith("-") else "run"
    rest = argv[1:] if argv and not argv[0].startswith("-") else argv
    try:
        if name == "run":
            return cmd_run(rest)
        if name == "plugins":
            return cmd_plugins(rest)
        if name == "convert":
            return cmd_convert(rest)
        if name == "dashboard":
            from miles_host.cli.dashboard import cmd_dashboard

            return cmd_dashboard(rest)
        manager = MilesPluginManager()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            manager.discover()
        commands = plugin_commands(manager)
        if name in commands:
            return cmd_plugin_command(commands[name], rest)
        known = ", ".join([*HOST_COMMANDS, *sorted(commands)])
        return _error(f"unknown command {name!r}; commands: {known}", 2)
    except PluginError as error:
        return _error(str(error), error.exit_code)
    except (UsageError,) as error:
        return _error(str(error), 2)
    except (ValueError, FileNotFoundError) as error:
        return _error(str(error), 2)
    except RunStopped as error:  # the run stopped itself: too many failed samples, NaN losses
        return _error(str(error), 1)
    except OutputWriteError as error:  # a full disk, a vanished mount: the message names the path
        return _error(str(error), 1)
    except KeyboardInterrupt as error:  # Ctrl-C, or SIGTERM / SIGHUP (run_control.Stopped): 128 + signal
        if isinstance(error, Stopped):
            return _error(f"stopped by {error.signal_name}", error.exit_code)
        return _error("interrupted", 130)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
