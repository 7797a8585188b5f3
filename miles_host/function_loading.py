"""``--*-path`` flags: ``package.module.fn`` strings to the functions they name."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Callable


def load_function(path: str, flag: str) -> Callable:
    """``package.module.fn`` -> the function; ValueError naming the flag otherwise.

    Modules are looked up on ``sys.path`` and then in the current directory (the
    ``miles`` console script, unlike ``python -m``, does not put it on the path)."""
    module_name, _, attribute = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{flag} must be 'module.function', got {path!r}")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # last: never shadows an installed module
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"{flag} {path!r}: cannot import {module_name!r}: {error} (searched the current directory {cwd} "
            "and sys.path; put the module there or add its folder to PYTHONPATH)"
        ) from error
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(f"{flag} {path!r}: {module_name} has no function {attribute!r}")
    return function
