"""Helpers to declare config fields that double as command-line flags.

A field declared with :func:`flag` carries its help text, type and aliases in the
dataclass metadata; :mod:`miles_host.cli.args` turns every such field into an
argparse option spelled like slime's (``rollout_batch_size`` ->
``--rollout-batch-size``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence


def flag(
    default: Any,
    help: str,
    *,
    type: Callable[[str], Any] | None = None,
    nargs: str | None = None,
    choices: Sequence[Any] | None = None,
    aliases: Sequence[str] = (),
    group: str = "",
) -> Any:
    """A dataclass field that is also a ``miles run`` flag.

    ``type`` is the argparse converter (omit for booleans: they become
    ``store_true`` flags); ``aliases`` are extra spellings (``--tis-threshold``).
    """
    metadata = {
        "help": help,
        "type": type,
        "nargs": nargs,
        "choices": choices,
        "aliases": tuple(aliases),
        "group": group,
    }
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type_copy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def type_copy(value: Any) -> Any:
    """A fresh copy of a mutable default."""
    return list(value) if isinstance(value, list) else dict(value)


def flag_name(field_name: str) -> str:
    """``rollout_batch_size`` -> ``--rollout-batch-size``."""
    return "--" + field_name.replace("_", "-")


def optional_int(text: str) -> int | None:
    """argparse type: an int, or ``none``."""
    return None if text.lower() in ("none", "null") else int(text)


def size_in_bytes(text: str) -> int:
    """argparse type: ``536870912``, ``512MB``, ``1GB``."""
    units = {"kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}
    lowered = text.strip().lower()
    for suffix, factor in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * factor)
    return int(float(lowered))
