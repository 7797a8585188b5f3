"""Checkpoints: everything a resumed run needs to continue as if never stopped.

``<save>/iter_<rollout_id>/state.pt`` holds the trainer (model, optimizer,
scheduler), the data position, the partial-rollout buffer and the RNG states;
``<save>/latest_checkpointed_iteration.txt`` names the newest (Megatron's layout).
A sharded trainer (``save_shards``) writes its ranks' files into a subfolder of
``iter_<rollout_id>/`` first; ``state.pt`` names it (``trainer.shards``).
``iter_<rollout_id>/manifest.json`` holds the checksum of ``state.pt`` (and of the shard files rank 0 wrote)
(:mod:`miles_host.checkpoint_integrity`). Loading verifies it, reads tensors and
plain data only (no code from the file runs), and refuses NaN/Inf in the trainer's
state; a damaged newest checkpoint is named and the newest intact earlier one is
loaded instead, with a warning.
"""

from __future__ import annotations

import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from miles_host.checkpoint_integrity import (
    CheckpointDamaged,
    load_state_file,
    nonfinite_tensors,
    verify_manifest,
    write_manifest,
    write_text_atomically,
)
from miles_host.run_control import remove_partial_files, write_error

LATEST = "latest_checkpointed_iteration.txt"
STATE = "state.pt"
_ITER = re.compile(r"iter_(\d{7,})")


def rng_state() -> dict:
    """Python, numpy and torch RNG states."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    # numpy's state as plain ints: a weights-only load reads no numpy objects
    numpy_state = [kind, [int(k) for k in keys], int(position), int(has_gauss), float(cached)]
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore :func:`rng_state`."""
    random.setstate(state["python"])
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(directory: str, rollout_id: int, payload: dict,
                    write_shards: Callable[[str], list[str]] | None = None) -> Path:
    """Write ``payload`` (plus RNG states) for ``rollout_id``; returns its folder.

    ``write_shards(folder)`` (a sharded trainer's ``save_shards``) writes the ranks' shard
    files into the folder first; the files it returns go into the manifest."""
    folder = Path(directory) / f"iter_{rollout_id:07d}"
    temporary = folder / "state.pt.tmp"
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        shard_files = list(write_shards(str(folder))) if write_shards is not None else []
        torch.save({**payload, "rollout_id": rollout_id, "rng": rng_state()}, temporary)
        temporary.replace(folder / STATE)  # a crash mid-write never leaves a torn checkpoint
        write_manifest(folder, rollout_id, [STATE, *shard_files])
        write_text_atomically(Path(directory) / LATEST, str(rollout_id))
    except (OSError, RuntimeError) as error:  # torch.save reports a full disk as a RuntimeError
        remove_partial_files(Path(directory))
        if created:  # no half-written iteration next to the intact ones
            shutil.rmtree(folder, ignore_errors=True)
        raise write_error(f"--save: the checkpoint of rollout {rollout_id} was not written (the previous one is "
                          "intact)", temporary, error) from error
    return folder


def has_checkpoint(directory: str | None) -> bool:
    """Whether ``--load`` has anything to resume: a latest-file or an ``iter_*`` folder. A missing
    or empty directory has not (the run starts fresh, as slime's does); a damaged one has, so
    :func:`load_checkpoint` reports it instead of a silent fresh start. A Megatron-written
    checkpoint (:func:`megatron_only`) has no miles state to resume: see :func:`fresh_start_note`."""
    if not directory or not Path(directory).is_dir() or megatron_only(directory):
        return False
    root = Path(directory)
    return (root / LATEST).exists() or any(_ITER.fullmatch(p.name) and p.is_dir() for p in root.iterdir())


def megatron_only(directory: str) -> bool:
    """Whether ``directory`` is a checkpoint Megatron (slime) wrote, not miles: the folder its
    latest-file names (``iter_*`` or ``release``), or the directory itself, holds
    ``megatron.core.dist_checkpointing``'s ``metadata.json`` and no ``state.pt``."""
    root = Path(directory)
    latest = root / LATEST
    folder = root
    if latest.is_file():
        text = latest.read_bytes()[:64].decode("utf-8", "replace").strip()
        folder = root / (f"iter_{int(text):07d}" if text.isdigit() else "release" if text == "release" else "")
    return folder.is_dir() and (folder / "metadata.json").is_file() and not (folder / STATE).exists()


def fresh_start_note(directory: str, trainer: Any) -> str:
    """What a run whose ``--load`` has nothing to resume starts from; a ``ValueError`` when it
    is a Megatron checkpoint that the training backend cannot read (``reads_megatron_checkpoints``)."""
    if not megatron_only(directory):
        return "no checkpoint there yet; starting fresh from --hf-checkpoint (as slime starts from --ref-load)"
    if not trainer.reads_megatron_checkpoints:
        raise ValueError(f"--load {directory} is a Megatron torch_dist checkpoint (no miles state.pt); this training "
                         "backend cannot read it: use --train-backend megatron, or give HF weights with --hf-checkpoint")
    return ("a Megatron checkpoint without miles' resume state: the policy started from its weights; the run starts "
            "at rollout 0 (slime's --finetune)")


def load_checkpoint(directory: str) -> dict[str, Any]:
    """The newest intact checkpoint under ``directory`` (``--load``).

    The iteration ``latest_checkpointed_iteration.txt`` names is tried first; when it
    (or that file) is damaged, the newest earlier iteration that passes
    :func:`read_checkpoint` is loaded and a warning names the damaged file.
    ``CheckpointDamaged`` (a ValueError) names the damaged file(s) when none is intact."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"--load {directory}: no such directory")
    folders, problems = _candidate_folders(root)
    if not folders and not problems:
        raise FileNotFoundError(f"--load {directory}: no {LATEST} and no iter_* folders there (not a miles checkpoint directory?)")
    for folder in folders:
        try:
            state = read_checkpoint(folder)
        except CheckpointDamaged as error:
            problems.append(str(error))
            continue
        if problems:
            print(f"miles: warning: --load {directory}: {'; '.join(problems)}; loading the newest intact "
                  f"checkpoint instead: {folder}", file=sys.stderr)
        set_rng_state(state["rng"])
        return state
    raise CheckpointDamaged(f"--load {directory}: no intact checkpoint: " + "; ".join(problems))


def read_checkpoint(folder: Path) -> dict[str, Any]:
    """One ``iter_*`` folder's state, verified: checksums of its manifest, a weights-only
    load, the fields a resume needs, and finite trainer tensors."""
    path = folder / STATE
    if not path.is_file():
        raise CheckpointDamaged(f"{path} is missing")
    if not verify_manifest(folder):
        print(f"miles: warning: {folder} has no manifest.json; {path} cannot be verified", file=sys.stderr)
    state = load_state_file(path)
    expected = int(_ITER.fullmatch(folder.name).group(1))
    if not isinstance(state, dict) or not {"trainer", "rng", "rollout_id"} <= set(state):
        raise CheckpointDamaged(f"{path} is not a miles checkpoint state (no trainer, rng and rollout_id entries)")
    if state["rollout_id"] != expected:
        raise CheckpointDamaged(f"{path} holds rollout {state['rollout_id']}, not {expected} as its folder says")
    bad = list(nonfinite_tensors(state["trainer"], "trainer"))
    if bad:
        listed = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise CheckpointDamaged(f"{path} is damaged: NaN/Inf values in {listed}")
    shards = state["trainer"].get("shards") if isinstance(state["trainer"], dict) else None
    if shards is not None:  # the subfolder a sharded trainer's ``save_shards`` wrote: its path now
        if not (folder / shards).is_dir():
            raise CheckpointDamaged(f"{folder / shards} is missing (the trainer's shards of {path})")
        state["trainer"]["shards"] = str(folder / shards)
    return state


def _candidate_folders(root: Path) -> tuple[list[Path], list[str]]:
    """``iter_*`` folders to try, newest first from the one the latest-file names; and the
    problems found with that file."""
    found = {int(m.group(1)): p for p in root.iterdir() if (m := _ITER.fullmatch(p.name)) and p.is_dir()}
    latest_file = root / LATEST
    problems = []
    latest = None
    if latest_file.is_file():
        text = latest_file.read_bytes()[:64].decode("utf-8", "replace").strip()
        if text.isdigit():
            latest = int(text)
        else:
            problems.append(f"{latest_file} is damaged (holds {text!r}, not an iteration number)")
    elif found:
        problems.append(f"{latest_file} is missing")
    if latest is not None and latest not in found:
        problems.append(f"{latest_file} names iteration {latest}, but {root / f'iter_{latest:07d}'} is missing")
    order = sorted((i for i in found if latest is None or i <= latest), reverse=True)
    return [found[i] for i in order], problems


def retained(rollout_id: int, interval: int) -> bool:
    """Whether ``--save-retain-interval`` keeps the checkpoint of ``rollout_id``: the ones taken
    after a multiple of ``interval`` completed rollouts (rollout ``interval - 1``, ``2 * interval - 1``, ...)."""
    return (rollout_id + 1) % interval == 0


def prune_checkpoints(directory: str, newest: int, interval: int | None) -> list[Path]:
    """With ``--save-retain-interval``: delete the ``iter_*`` folders older than ``newest`` that
    :func:`retained` does not keep (Megatron's retention: between retained checkpoints only the
    newest one stays). Folders newer than ``newest`` (a resumed run's abandoned future) are left
    alone. Returns the folders deleted."""
    if interval is None:
        return []
    root = Path(directory)
    deleted = []
    for path in sorted(root.iterdir()):
        match = _ITER.fullmatch(path.name)
        if match and path.is_dir() and int(match.group(1)) < newest and not retained(int(match.group(1)), interval):
            shutil.rmtree(path)
            deleted.append(path)
    return deleted
