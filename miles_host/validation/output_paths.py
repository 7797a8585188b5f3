"""Output paths are checked before the run starts, not when first written.

``--output-dir``, ``--save`` and ``--save-hf`` must name directories that exist or
can be created (no file on the way, a writable ancestor), and ``--save-hf``'s
template may only use the keys of :data:`SAVE_HF_KEYS`.
"""

from __future__ import annotations

import os
import string
from pathlib import Path
from typing import Any

#: the keys a ``--save-hf`` template may use, and what each is
SAVE_HF_KEYS = {"rollout_id": "the rollout the weights were saved after"}


def save_hf_path(template: str, rollout_id: int) -> str:
    """``--save-hf`` with its keys filled in."""
    return template.format(rollout_id=rollout_id)


def check_save_hf_template(template: str) -> None:
    """A ``--save-hf`` template parses and uses only :data:`SAVE_HF_KEYS` (by name)."""
    allowed = ", ".join("{" + key + "}" for key in SAVE_HF_KEYS)
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as error:
        raise ValueError(
            f"--save-hf {template!r} is not a valid template ({error}); write a literal brace as '{{{{' or '}}}}', "
            f"keys: {allowed}"
        ) from None
    for name in fields:
        key = name.split(".")[0].split("[")[0]
        if key not in SAVE_HF_KEYS:
            what = "a positional {}" if key == "" or key.isdigit() else f"unknown key {{{name}}}"
            raise ValueError(f"--save-hf {template!r}: {what}; the keys it may use: {allowed}")
    try:
        save_hf_path(template, 0)
    except (ValueError, KeyError, IndexError, AttributeError) as error:
        raise ValueError(f"--save-hf {template!r} cannot be filled in ({error}); keys: {allowed}") from None


def check_directory_creatable(path: str, flag: str) -> None:
    """``path`` is a writable directory, or one that can be created (the nearest existing
    ancestor is a writable directory)."""
    target = Path(path).expanduser()
    if target.exists():
        if not target.is_dir():
            raise ValueError(f"{flag} {path} is a file, not a directory; choose another {flag}")
        if not os.access(target, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {path}: the directory is not writable by this user")
        return
    ancestor = target.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"{flag} {path} cannot be created: {ancestor} is a file, not a directory; choose another {flag}")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path} cannot be created: {ancestor} is not writable by this user")


def check_output_paths(config: Any, registries: Any = None) -> None:
    """``--output-dir``, ``--save``, ``--save-hf``: creatable directories, a valid template."""
    if config.output_dir is not None:
        check_directory_creatable(config.output_dir, "--output-dir")
    if config.save:
        check_directory_creatable(config.save, "--save")
    if config.save_hf:
        check_save_hf_template(config.save_hf)
        check_directory_creatable(save_hf_path(config.save_hf, 0), "--save-hf")
