"""Slime's ``--load`` / ``--ref-load`` of Megatron torch_dist checkpoints for the megatron backend.

Slime's meanings (``slime/utils/arguments.py``): ``--ref-load`` is the reference model's
Megatron checkpoint and, when ``--load`` holds no checkpoint, the actor's starting
weights too; ``--load`` resumes a Megatron checkpoint directory
(``latest_checkpointed_iteration.txt`` naming ``iter_*`` or ``release``); ``--save`` is
where checkpoints go. Here:

- ``--ref-load DIR`` of a torch_dist checkpoint (e.g. one converted from HF for slime):
  the reference model and the policy's starting weights are read from it, each rank
  its own shards; ``--hf-checkpoint`` still gives the architecture and tokenizer.
- ``--load DIR`` of a miles checkpoint (``state.pt`` + ``torch_dist/``) resumes
  everything (the host's checkpoint, :mod:`miles_megatron.dist_ckpt`).
- ``--load DIR`` of a checkpoint Megatron (slime) wrote, which has no miles resume
  state (data position, RNG, schedule): the policy starts from its weights, with fresh
  optimizer moments, at rollout 0 (slime's ``--finetune`` with ``--no-load-optim``; the
  optimizer state such a run writes follows its own flags, bf16 masters and the
  distributed optimizer's sharding among them, not this trainer's).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LATEST = "latest_checkpointed_iteration.txt"
#: what a miles checkpoint's ``iter_*`` folder holds beside its shards
MILES_STATE = "state.pt"


def megatron_folder(path: str | None) -> Path | None:
    """The torch_dist folder of a checkpoint Megatron wrote at ``path`` (the folder itself,
    or the ``iter_*`` / ``release`` folder its latest-file names); ``None`` when ``path`` is
    not one, or is a miles checkpoint (its ``iter_*`` folder has a ``state.pt``)."""
    from miles_megatron.dist_ckpt import is_torch_dist

    if not path or not Path(path).is_dir():
        return None
    root = Path(path)
    if is_torch_dist(root):
        return root
    latest = root / LATEST
    if not latest.is_file():
        return None
    text = latest.read_text().strip()
    folder = root / ("release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else text)
    if (folder / MILES_STATE).is_file() or not is_torch_dist(folder):
        return None
    return folder


def architecture_source(config: Any, path: str) -> str:
    """Where the model of ``path`` is built from: ``path`` itself (an HF directory), or for
    a torch_dist checkpoint ``--hf-checkpoint`` (its weights then replaced by the shards)."""
    if megatron_folder(path) is None:
        return path
    if not config.hf_checkpoint:
        raise ValueError(f"{path} is a Megatron torch_dist checkpoint: give the model's HF directory with "
                         "--hf-checkpoint too (its config.json builds the model, the checkpoint gives the weights)")
    return config.hf_checkpoint


def load_start_weights(trainer: Any) -> None:
    """After the trainer is built: the shards of ``--ref-load`` into the reference model and
    the policy, then those of a Megatron-written ``--load`` into the policy (see module doc)."""
    from miles_megatron.dist_ckpt import load_model_shards

    config = trainer.config
    reference = megatron_folder(config.ref_load)
    if reference is not None:
        logger.info("--ref-load %s: reference and starting policy weights from %s", config.ref_load, reference)
        for model in (trainer.ref_model, trainer.model):
            for chunk in model.chunks if model is not None else []:  # (virtual pipeline stages: each chunk)
                load_model_shards(chunk, reference, trainer.device)
    start = megatron_folder(config.load)
    if start is not None:
        logger.info("--load %s: a Megatron checkpoint without miles' resume state: the policy starts from its "
                    "weights (%s) at rollout 0", config.load, start)
        for chunk in trainer.model.chunks:
            load_model_shards(chunk, start, trainer.device)
