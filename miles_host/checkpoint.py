"""Checkpoints: everything a resumed run needs to continue as if never stopped.

``<save>/iter_<rollout_id>/state.pt`` holds the trainer (model, optimizer,
scheduler), the data position, the partial-rollout buffer and the RNG states;
``<save>/latest_checkpointed_iteration.txt`` names the newest (Megatron's layout).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

LATEST = "latest_checkpointed_iteration.txt"


def rng_state() -> dict:
    """Python, numpy and torch RNG states."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore :func:`rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(directory: str, rollout_id: int, payload: dict) -> Path:
    """Write ``payload`` (plus RNG states) for ``rollout_id``; returns its folder."""
    folder = Path(directory) / f"iter_{rollout_id:07d}"
    folder.mkdir(parents=True, exist_ok=True)
    temporary = folder / "state.pt.tmp"
    torch.save({**payload, "rollout_id": rollout_id, "rng": rng_state()}, temporary)
    temporary.replace(folder / "state.pt")  # a crash mid-write never leaves a torn checkpoint
    (Path(directory) / LATEST).write_text(str(rollout_id))
    return folder


def load_checkpoint(directory: str) -> dict[str, Any]:
    """The newest checkpoint under ``directory`` (``--load``)."""
    root = Path(directory)
    latest = root / LATEST
    if not latest.is_file():
        raise FileNotFoundError(f"--load {directory}: no {LATEST} there (not a miles checkpoint directory?)")
    rollout_id = int(latest.read_text().strip())
    path = root / f"iter_{rollout_id:07d}" / "state.pt"
    if not path.is_file():
        raise FileNotFoundError(f"--load {directory}: {path} is missing")
    state = torch.load(path, map_location="cpu", weights_only=False)
    set_rng_state(state["rng"])
    return state
