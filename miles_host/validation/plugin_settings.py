"""Plugins set config values only where the user did not.

``miles_configure`` implementations run one at a time, in registration order
(built-ins first); the fields each one changed are compared with what the user
gave (``config.user_set``: flags on the command line or keys of ``--config``).
A plugin changing a field the user set, or two plugins setting one field to
different values, is a ValueError naming both sides (exit code 2).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from miles_host.config import MilesConfig
from miles_host.config_fields import flag_name


def user_set_fields(config: Any) -> set[str]:
    """Fields the user gave: ``config.user_set`` when the CLI recorded it, else (a config
    built in Python) the fields that differ from their dataclass default."""
    recorded = getattr(config, "user_set", None)
    if recorded is not None:
        return set(recorded)
    changed = set()
    for f in dataclasses.fields(MilesConfig):
        if f.name not in MilesConfig.field_names():
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if getattr(config, f.name) != default:
            changed.add(f.name)
    return changed


def _snapshot(config: Any) -> dict[str, Any]:
    return {name: copy.copy(getattr(config, name)) for name in MilesConfig.field_names()}


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def configure_with_plugins(config: Any, manager: Any) -> dict[str, str]:
    """Call every active plugin's ``miles_configure`` in registration order and refuse
    changes to user-set fields and conflicting changes; returns ``{field: plugin}`` for
    the fields plugins set."""
    given = user_set_fields(config)
    owners: dict[str, tuple[str, Any]] = {}
    for impl in manager.hook.miles_configure.get_hookimpls():
        before = _snapshot(config)
        impl.function(**{name: config for name in impl.argnames})
        plugin = impl.plugin_name
        for name, old in before.items():
            new = getattr(config, name)
            if new == old:
                continue
            flag = flag_name(name)
            if name in given:
                raise ValueError(
                    f"plugin {plugin!r} sets {flag} {_shown(new)}, but {flag} {_shown(old)} was given; "
                    f"drop {flag} or the plugin ({plugin})"
                )
            if name in owners and owners[name][1] != new:
                first, value = owners[name]
                raise ValueError(
                    f"plugins {first!r} and {plugin!r} both set {flag} ({_shown(value)} and {_shown(new)}); "
                    f"activate only one of them"
                )
            owners[name] = (plugin, copy.copy(new))
    return {name: plugin for name, (plugin, _) in owners.items()}
