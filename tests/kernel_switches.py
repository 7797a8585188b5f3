"""Kernel switches in tests: set for one test, checked like the flag, restored after it."""

from __future__ import annotations

from miles_host.kernels import switches


def use_switches(monkeypatch, **values) -> None:
    """Set kernel switches (``fp8_small_m_mma=0``) until the test ends."""
    for name, value in values.items():
        monkeypatch.setitem(switches.VALUES, name, switches.declared(name).check(value))
