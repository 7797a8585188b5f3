"""Kernel switches: choices between implementations of one computation (which GEMM,
which weight layout, a plain-PyTorch reference path for debugging).

A switch is a config value, never an environment variable: each one is a flag of the
run (a host field or a plugin flag of the same name), recorded in the run's
``config.json``, and set in every process of the run from its config by
:func:`apply_config` (the owning plugin's ``miles_process_start``). A kernel module
declares its switch with :func:`declare` and reads it with :func:`value`; tests and
benchmarks choose with :func:`switched` or :func:`setVALUES`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

from miles_host.config_kernels import HOST_SWITCHES


@dataclass(frozen=True)
class Switch:
    """One kernel switch: its config name, default, allowed values and help text."""

    name: str
    default: Any
    choices: Sequence[Any] | None
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, value: Any) -> Any:
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{self.flag} {value!r}: choose from {', '.join(map(str, self.choices))}")
        if self.choices is None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"{self.flag} {value!r}: give a count >= 0")
        return value


_DECLARED: dict[str, Switch] = {}
#: the switches set in this process (name -> value); unset ones have their default
VALUES: dict[str, Any] = {}


def declare(name: str, default: Any, choices: Sequence[Any] | None, help: str) -> Switch:
    """Declare a switch (``choices`` None: a count >= 0); returns it. Declaring a name twice
    with different settings is an error."""
    switch = Switch(name, default, tuple(choices) if choices is not None else None, help)
    existing = _DECLARED.setdefault(name, switch)
    if existing != switch:
        raise ValueError(f"kernel switch {name!r} declared twice with different settings")
    return switch


def declare_host(name: str) -> Switch:
    """Declare host switch ``name`` from its record in :data:`miles_host.config_kernels.HOST_SWITCHES`
    (the record the run config's flag is made from)."""
    spec = HOST_SWITCHES[name]
    return declare(spec.name, spec.default, spec.choices, spec.help)


def host_switches() -> list[Switch]:
    """Every switch of :data:`miles_host.config_kernels.HOST_SWITCHES` (the records the run config's
    flags are made from), declared from its record if its kernel module has not been imported."""
    return [declare_host(name) for name in HOST_SWITCHES]


def declared(name: str) -> Switch:
    """The switch called ``name`` (ValueError listing the declared ones)."""
    if name not in _DECLARED:
        raise ValueError(f"unknown kernel switch {name!r}; known: {', '.join(sorted(_DECLARED))}")
    return _DECLARED[name]


def value(switch: Switch) -> Any:
    """The switch's value in this process (its default until set)."""
    return VALUES.get(switch.name, switch.default)


def setVALUES(**values: Any) -> dict[str, Any]:
    """Set switches by name; returns their previous values (for :func:`switched`)."""
    previous = {}
    for name, new in values.items():
        switch = declared(name)
        previous[name] = value(switch)
        VALUES[name] = switch.check(new)
    return previous


@contextlib.contextmanager
def switched(**values: Any) -> Iterator[None]:
    """Set switches for the ``with`` block, then restore them."""
    previous = setVALUES(**values)
    try:
        yield
    finally:
        VALUES.update(previous)


def add_flags(group: Any, switches: Iterable[Switch]) -> None:
    """Add one ``miles run`` flag per switch to an argparse group (plugins' ``miles_add_arguments``)."""
    for switch in switches:
        kind = type(switch.default)
        group.add_argument(switch.flag, dest=switch.name, default=switch.default, type=kind,
                           choices=switch.choices, help=f"kernel switch: {switch.help}")


def apply_config(config: Any, switches: Iterable[Switch]) -> None:
    """Set ``switches`` from the config values of the same names (in every process of a run)."""
    setVALUES(**{switch.name: getattr(config, switch.name) for switch in switches})


__all__ = ["VALUES", "Switch", "add_flags", "apply_config", "declare", "declare_host", "declared", "host_switches",
           "setVALUES",
           "switched", "value"]
