"""Regenerate the rows of miles_host/sglang_args_data.py from SGLang's and sglang-router's wheels.

    pip download sglang==VERSION sglang-router==VERSION --no-deps -d wheels/
    python scripts/pin_sglang_args.py wheels/sglang-*.whl wheels/sglang_router-*.whl > rows.py

SGLang's ``ServerArgs.add_cli_args`` and the router's ``RouterArgs.add_cli_args(parser,
use_router_prefix=True, exclude_host_port=True)`` fill an argparse parser here, with every
other ``sglang`` module replaced by a stand-in (only the argument modules,
``sglang/srt/server_args.py`` and ``sglang/srt/arg_groups/``, run for real), so neither
package nor their GPU dependencies need to be installed. The output is the
``SERVER_ARGS`` and ``ROUTER_ARGS`` tuples; paste them over the old ones and update the
version strings in the module docstring and constants.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
import tempfile
import textwrap
import zipfile
from pathlib import Path
from unittest import mock

SWITCH_ACTIONS = ("_StoreTrueAction", "DeprecatedStoreTrueAction", "DeprecatedStoreConstAction", "DeprecatedAction",
                  "BooleanOptionalAction")


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any module under ``stubbed`` is a MagicMock, except files found under ``real_root``."""

    def __init__(self, stubbed: tuple[str, ...], real_root: Path):
        self.stubbed, self.real_root = stubbed, real_root

    def find_spec(self, name, path, target=None):
        real = self.real_root.joinpath(*name.split(".")).with_suffix(".py")
        if name.startswith("sglang.srt.arg_groups.") and real.exists():
            return importlib.util.spec_from_file_location(name, real)
        if name.split(".")[0] in self.stubbed:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__, module.__name__ = [], spec, spec.name
        return module

    def exec_module(self, module):
        pass


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while building the class
    spec.loader.exec_module(module)
    return module


def _kind(action: argparse.Action) -> str:
    if type(action).__name__ in SWITCH_ACTIONS:
        return "bool"
    converter = getattr(action.type, "__name__", None) or repr(action.type)
    for marker, kind in (("human_readable_int", "size"), ("json_list", "json"), ("loads", "json")):
        if marker in converter:
            return kind
    return {"int": "int", "float": "float"}.get(converter, "str")


def _help(text: str | None) -> str:
    text = " ".join((text or "").split()).replace("%%", "%")
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    first = match.group(1) if match else text
    return first if len(first) <= 220 else first[:217].rstrip() + "..."


def _rows(parser: argparse.ArgumentParser, prefix: str) -> list[str]:
    lines = []
    for action in parser._actions:
        flags = [f for f in action.option_strings if f.startswith("--" + prefix)
                 and not (isinstance(action, argparse.BooleanOptionalAction) and f.startswith("--no-"))]
        if not flags:
            continue
        names = [f[2 + len(prefix):] for f in flags]
        kind = _kind(action)
        default = None if kind == "bool" or action.default in ("==SUPPRESS==", {}, []) else action.default
        default = False if kind == "bool" else default
        nargs = action.nargs if kind != "bool" and action.nargs not in (None, 1) else None
        args = [repr(names[0]), repr(kind), repr(default), repr(_help(action.help))]
        args += [f"nargs={nargs!r}"] if nargs else []
        args += [f"aliases={tuple(names[1:])!r}"] if names[1:] else []
        line = f"    A({', '.join(args)}),"
        if len(line) > 120:
            wrapped = [f"      {part!r}" for part in textwrap.wrap(_help(action.help), 96, drop_whitespace=False)]
            wrapped[-1] += ","
            line = "\n".join([f"    A({', '.join(args[:3])},", *wrapped,
                              *(["      " + ", ".join(args[4:]) + ","] if args[4:] else []), "    ),"])
        lines.append(line)
    return lines


def main(sglang_wheel: str, router_wheel: str) -> None:
    root = Path(tempfile.mkdtemp(prefix="pin-sglang-args-"))
    for wheel in (sglang_wheel, router_wheel):
        with zipfile.ZipFile(wheel) as archive:
            wanted = [n for n in archive.namelist() if n == "sglang/srt/server_args.py"
                      or n.startswith("sglang/srt/arg_groups/") or n == "sglang_router/router_args.py"]
            archive.extractall(root, wanted)
    sys.meta_path.insert(0, _StandIns(("sglang", "sglang_router"), root))
    server = argparse.ArgumentParser(add_help=False)
    _load(root / "sglang/srt/server_args.py", "pinned_server_args").ServerArgs.add_cli_args(server)
    router = argparse.ArgumentParser(add_help=False)
    _load(root / "sglang_router/router_args.py", "pinned_router_args").RouterArgs.add_cli_args(
        router, use_router_prefix=True, exclude_host_port=True)
    print("SERVER_ARGS: tuple[A, ...] = (\n" + "\n".join(_rows(server, "")) + "\n)\n")
    print("ROUTER_ARGS: tuple[A, ...] = (\n" + "\n".join(_rows(router, "router-")) + "\n)")


if __name__ == "__main__":
    main(*sys.argv[1:])
