"""Integrity of checkpoint files: a manifest of checksums, safe loading, finite values.

Each ``iter_<rollout_id>/`` folder holds ``manifest.json``::

    {"format": 1, "rollout_id": 12, "files": {"state.pt": {"bytes": 123, "sha256": "..."}}}

written after the files it lists and checked before any of them is read, so bit rot
or a torn copy is reported with the file's name instead of loading silently. State
files are read with ``torch.load(weights_only=True)``: tensors and plain Python
data only, so a shared or downloaded checkpoint cannot run code when loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any, Iterator

import torch

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_CHUNK = 8 << 20


class CheckpointDamaged(ValueError):
    """A checkpoint file is missing, altered, unreadable, unsafe or holds NaN/Inf."""


def sha256_of(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_text_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so a reader sees the old or the new content, never a torn one."""
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    temporary.replace(path)


def write_manifest(folder: Path, rollout_id: int, names: list[str]) -> Path:
    """Record size and SHA-256 of each file ``names`` in ``folder/manifest.json``."""
    files = {name: {"bytes": (folder / name).stat().st_size, "sha256": sha256_of(folder / name)} for name in names}
    manifest = {"format": MANIFEST_FORMAT, "rollout_id": rollout_id, "files": files}
    path = folder / MANIFEST
    write_text_atomically(path, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return path


def verify_manifest(folder: Path) -> bool:
    """Check every file ``folder/manifest.json`` lists against its size and checksum.

    Returns False when the folder has no manifest (nothing to verify); raises
    :class:`CheckpointDamaged` naming the file when one differs, is missing, or the
    manifest itself is unreadable."""
    path = folder / MANIFEST
    if not path.is_file():
        return False
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        entries = {str(name): (int(entry["bytes"]), str(entry["sha256"])) for name, entry in files.items()}
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointDamaged(f"{path} is damaged (not a manifest of checksums: {error})") from error
    for name, (size, checksum) in entries.items():
        file = folder / name
        if not file.is_file():
            raise CheckpointDamaged(f"{file} is missing (listed in {path})")
        actual_size = file.stat().st_size
        if actual_size != size:
            raise CheckpointDamaged(
                f"{file} is damaged: {actual_size} bytes, {path} recorded {size} (truncated or changed after saving)"
            )
        actual = sha256_of(file)
        if actual != checksum:
            raise CheckpointDamaged(
                f"{file} is damaged: its SHA-256 {actual[:16]}... differs from {checksum[:16]}... recorded in "
                f"{path} (bit rot, or the file was changed after saving)"
            )
    return True


def load_state_file(path: Path) -> Any:
    """``torch.load`` of a state file, tensors and plain data only (no code runs)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        named = re.search(r"GLOBAL ([\w.]+)", str(error))
        reason = f"it asks for {named.group(1)}" if named else "it holds objects other than tensors and plain data"
        raise CheckpointDamaged(
            f"{path} was refused: {reason}, and loading that would run code from the file. A miles "
            "checkpoint never needs that; do not load files of unknown origin"
        ) from error
    except Exception as error:  # noqa: BLE001 - the zip reader raises RuntimeError, EOFError, OSError, ...
        raise CheckpointDamaged(
            f"{path} is damaged: it cannot be read as a torch.save file ({type(error).__name__}: {error})"
        ) from error


def nonfinite_tensors(value: Any, prefix: str = "") -> Iterator[str]:
    """Dotted names of the floating-point tensors inside ``value`` (nested dicts,
    lists, tuples) that hold a NaN or an infinity."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.numel():
            readable = value if value.element_size() > 1 else value.float()  # no isfinite kernels for float8
            if not bool(torch.isfinite(readable).all()):
                yield prefix or "<tensor>"
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from nonfinite_tensors(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from nonfinite_tensors(item, f"{prefix}.{index}" if prefix else str(index))
