"""``--sglang-*`` and ``--router-*``: every SGLang server and router argument, as slime spells them.

slime adds SGLang's ``ServerArgs`` options with an ``sglang-`` prefix and the router's
``RouterArgs`` options with a ``router-`` prefix; miles accepts the same flags, from the
pinned list in :mod:`miles_host.sglang_args_data` (SGLang and sglang-router versions named
there). A flag ``--sglang-<name>`` is the config field ``sglang_<name>`` (dashes become
underscores); SGLang's other spellings of an option are aliases (``--sglang-ep`` and
``--sglang-expert-parallel-size`` for ``--sglang-ep-size``).

What becomes of them: the SGLang servers miles launches get every given server flag on their
command line (:func:`server_flags`; ``miles_sglang.launcher``); the embedded engine honours the
ones with a meaning for it and warns once about the rest (:mod:`miles_host.sglang_embedded`).
Options miles sets itself (:data:`MILES_SETS`: the model path, the port, the tensor-parallel
size, ...) are refused when given, naming the miles flag to use. ``--sglang-config`` is slime's
flag (a YAML of server groups), not SGLang's ``--config``. Router flags configure an SGLang
router, which miles does not start; they are accepted and warned about.

SGLang switches removed before the pinned version that slime scripts still give
(``--sglang-enable-ep-moe``, ``--sglang-enable-deepep-moe``, ...; the
:data:`~miles_host.sglang_args_data.REMOVED_SERVER_SWITCHES` rows) are accepted as deprecated
aliases: they set the option SGLang set in their place (``--sglang-ep-size`` to the engine's
tensor parallel size, ``--sglang-moe-a2a-backend deepep``), with one warning line
(:func:`apply_removed_switches`), and are never passed on themselves.

Host fields declared elsewhere with an ``sglang_`` name (``--sglang-mem-fraction-static``, the
speculative flags) keep their declaration: these dataclasses are the last bases of
``MilesConfig``, so the earlier declaration wins.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from typing import Any, Callable

from miles_host.config_fields import flag, flag_name
from miles_host.sglang_args_data import (
    REMOVED_SERVER_SWITCHES,
    ROUTER_ARGS,
    SERVER_ARGS,
    SGLANG_ROUTER_VERSION,
    SGLANG_VERSION,
    A,
    Removed,
)

_SI = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def readable_int(text: str) -> int:
    """argparse type of SGLang's sizes: ``32768``, ``32k`` (10**3), ``32Ki`` (2**10), ``1.5M``."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", text.strip())
    if match is None:
        return int(text)
    number, suffix = match.groups()
    if suffix in _IEC:
        if "." in number:
            raise ValueError(f"{text}: no decimals with the binary suffix {suffix}")
        return int(number) * _IEC[suffix]
    return int(float(number) * _SI[suffix])


def json_text(text: str) -> str:
    """argparse type of SGLang's JSON options: the text itself, once it parses as JSON."""
    json.loads(text)
    return text


#: how each kind of :class:`~miles_host.sglang_args_data.A` is read (None: a switch)
KIND_TYPES: dict[str, Callable[[str], Any] | None] = {
    "str": str, "int": int, "float": float, "size": readable_int, "json": json_text, "bool": None,
}

#: SGLang server options miles sets itself (slime skips the same ones): name -> what sets it
MILES_SETS: dict[str, str] = {
    "model-path": "--hf-checkpoint",
    "tp-size": "--rollout-num-gpus-per-engine (tensor parallel size of each launched server)",
    "port": "the launcher (a free port per server)",
    "trust-remote-code": "the model loader (local HF directories of supported families)",
    "random-seed": "--rollout-seed",
    "enable-memory-saver": "--colocate / --offload-rollout (servers miles launches release memory with it)",
    "nnodes": "the launcher (one node per server)",
    "node-rank": "the launcher (one node per server)",
    "dist-init-addr": "the launcher (one node per server)",
    "nccl-port": "the launcher",
    "base-gpu-id": "the launcher (servers after the trainers' GPUs, --rollout-num-gpus-per-engine each)",
    "gpu-id-step": "the launcher",
    "skip-server-warmup": "the launcher",
    "enable-return-routed-experts": "--rollout-return-routed-experts (set by routing-replay plugins)",
}

#: slime's router defaults where they differ from sglang-router's (slime sets them in its parser)
SLIME_ROUTER_DEFAULTS: dict[str, Any] = {"log-level": "warn", "balance-abs-threshold": 10, "balance-rel-threshold": 1.2}

#: server options that become the explicit fields below instead of a generated one
_OWN_FIELDS = ("config",)


def server_field(name: str) -> str:
    """``ep-size`` -> ``sglang_ep_size``."""
    return "sglang_" + name.replace("-", "_")


def router_field(name: str) -> str:
    """``policy`` -> ``router_policy``."""
    return "router_" + name.replace("-", "_")


def _field(arg: A, prefix: str, default: Any, group: str, origin: str) -> tuple[str, Any, Any]:
    name = prefix + arg.name.replace("-", "_")
    aliases = ["--" + (prefix + alias).replace("_", "-") for alias in arg.aliases]
    help_text = (f"{origin}: {arg.help}" if arg.help else origin).replace("%", "%%")  # argparse formats help
    if arg.kind == "bool":
        return name, bool, flag(False, help_text, aliases=aliases, group=group)
    return name, Any, flag(default, help_text, type=KIND_TYPES[arg.kind], nargs=arg.nargs, aliases=aliases,
                           group=group)


#: SGLang options whose value miles sets itself, and the config field it takes it from (what a removed
#: switch copies: ``--enable-ep-moe`` set ``--ep-size`` to ``--tp-size``)
MILES_VALUES: dict[str, str] = {"tp-size": "rollout_num_gpus_per_engine"}


def _removed_meaning(switch: Removed) -> str:
    if switch.copy_of is not None:
        source = MILES_VALUES.get(switch.copy_of)
        origin = f"{flag_name(source)}, " if source else ""
        return f"--sglang-{switch.target} = the engine's --{switch.copy_of} ({origin}as SGLang set it)"
    return f"--sglang-{switch.target} {switch.value}"


def _removed_field(switch: Removed) -> tuple[str, Any, Any]:
    return server_field(switch.name), bool, flag(
        False, f"deprecated: removed from SGLang; accepted as SGLang mapped it: {_removed_meaning(switch)}",
        group="sglang")


_SERVER_ORIGIN = f"SGLang {SGLANG_VERSION} server"
_ROUTER_ORIGIN = f"sglang-router {SGLANG_ROUTER_VERSION}"

SGLangServerArgs = dataclasses.make_dataclass(
    "SGLangServerArgs",
    [
        *(_field(arg, "sglang_", arg.default, "sglang", _SERVER_ORIGIN) for arg in SERVER_ARGS
          if arg.name not in _OWN_FIELDS),
        *(_removed_field(switch) for switch in REMOVED_SERVER_SWITCHES),
        ("sglang_config", Any, flag(
            None, "slime's YAML of SGLang server groups (per-group worker types and ServerArgs overrides); miles "
            "launches one group of identical servers, so it is refused with the sglang backend", type=str,
            group="sglang")),
    ],
)
SGLangServerArgs.__doc__ = "Every SGLang server argument as ``--sglang-<name>`` (see the module docstring)."

SGLangRouterArgs = dataclasses.make_dataclass(
    "SGLangRouterArgs",
    [
        *(_field(arg, "router_", SLIME_ROUTER_DEFAULTS.get(arg.name, arg.default), "router", _ROUTER_ORIGIN)
          for arg in ROUTER_ARGS),
        ("sglang_router_request_timeout_secs", Any, flag(
            14400, "slime: seconds a request to the SGLang router may take", type=int, group="router")),
    ],
)
SGLangRouterArgs.__doc__ = "Every sglang-router argument as ``--router-<name>`` (see the module docstring)."

#: field name -> its pinned row, for every server option (host-declared ones included)
SERVER_ARGS_BY_FIELD: dict[str, A] = {server_field(arg.name): arg for arg in SERVER_ARGS}
#: field name -> its pinned row, for every router option
ROUTER_ARGS_BY_FIELD: dict[str, A] = {router_field(arg.name): arg for arg in ROUTER_ARGS}


def _default_of(config: Any, name: str, fallback: Any) -> Any:
    fields = getattr(type(config), "__dataclass_fields__", {})
    f = fields.get(name)
    if f is None:
        return fallback
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def given_server_args(config: Any) -> list[tuple[A, Any]]:
    """The SGLang server options whose value differs from the default, with that value, in
    the pinned order (``--sglang-config`` and the :data:`MILES_SETS` options excluded)."""
    given = []
    for name, arg in SERVER_ARGS_BY_FIELD.items():
        if arg.name in MILES_SETS or arg.name in _OWN_FIELDS or not hasattr(config, name):
            continue
        value = getattr(config, name)
        if value != _default_of(config, name, False if arg.kind == "bool" else arg.default):
            given.append((arg, value))
    return given


def given_router_flags(config: Any) -> list[str]:
    """The ``--router-*`` flags (and ``--sglang-router-request-timeout-secs``) set to a
    non-default value."""
    names = [*ROUTER_ARGS_BY_FIELD, "sglang_router_request_timeout_secs"]
    return [flag_name(name) for name in names
            if hasattr(config, name) and getattr(config, name) != _default_of(config, name, None)]


def server_flags(config: Any, only: Any = None, exclude: Any = ()) -> list[str]:
    """The given server options as an SGLang command line (``--ep-size 8 --enable-dp-attention``);
    ``only`` / ``exclude``: SGLang option names to keep / to leave out."""
    argv: list[str] = []
    for arg, value in given_server_args(config):
        if (only is not None and arg.name not in only) or arg.name in exclude:
            continue
        option = "--" + arg.name
        if value is True:
            argv.append(option)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            argv += [option, *map(str, value)]
        else:
            argv += [option, str(value)]
    return argv


_warned_removed: set[str] = set()


def apply_removed_switches(config: Any, stream: Any = None) -> dict[str, Any]:
    """Each given removed switch (:data:`~miles_host.sglang_args_data.REMOVED_SERVER_SWITCHES`) sets
    its target option as SGLang did; one warning line (per process) names them. A target given
    with another value is a ValueError. Returns ``{target field: value}`` for the switches given;
    applying twice changes nothing."""
    applied: dict[str, Any] = {}
    names = []
    for switch in REMOVED_SERVER_SWITCHES:
        if not getattr(config, server_field(switch.name), False):
            continue
        target = server_field(switch.target)
        value = getattr(config, MILES_VALUES[switch.copy_of]) if switch.copy_of is not None else switch.value
        current = getattr(config, target)
        default = _default_of(config, target, SERVER_ARGS_BY_FIELD[target].default)
        if current not in (default, value):
            raise ValueError(
                f"--sglang-{switch.name} sets {flag_name(target)} {value} (SGLang's mapping of the removed switch), "
                f"but {flag_name(target)} is {current}; give one of the two")
        setattr(config, target, value)
        applied[target] = value
        names.append(f"--sglang-{switch.name} (now {flag_name(target)} {value})")
    new = [name for name in names if name not in _warned_removed]
    if new:
        _warned_removed.update(new)
        print(f"miles: warning: deprecated SGLang switches, removed from SGLang and applied as it mapped them: "
              f"{', '.join(new)}", file=stream or sys.stderr)
    return applied


def check_sglang_args(config: Any) -> None:
    """The options miles sets itself are refused when given, naming what sets them; the removed
    switches given are applied first (:func:`apply_removed_switches`)."""
    apply_removed_switches(config)
    for name, instead in MILES_SETS.items():
        field_name = server_field(name)
        arg = SERVER_ARGS_BY_FIELD[field_name]
        value = getattr(config, field_name, None)
        if value != _default_of(config, field_name, False if arg.kind == "bool" else arg.default):
            raise ValueError(f"{flag_name(field_name)}: miles sets SGLang's --{name} itself, from {instead}; "
                             "drop the flag")
