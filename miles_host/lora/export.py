"""What leaves the trainer of a LoRA run: merged weights for the rollout engine and
``--save-hf --merge-lora``, the PEFT adapter for ``--save-hf`` and checkpoints.

With ``--lora-sync merged`` (the default) the engine keeps a plain model: at every weight
sync it loads ``W + scaling * B @ A`` (float32 arithmetic, cast to W's dtype) under the
native names, so what it samples from is exactly the merged model (``--lora-sync adapter``:
:mod:`miles_host.lora.sync`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from miles_host.lora.modules import lora_modules
from miles_host.lora.peft_io import save_adapter


def merged_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``state`` (default: ``model.state_dict()``) with each LoRA layer's adapters merged into
    its base weight and the ``lora_A``/``lora_B`` entries dropped: the native names and shapes
    of the model without adapters. Unchanged when the model carries none."""
    state = state if state is not None else model.state_dict()
    layers = lora_modules(model)
    if not layers:
        return state
    out = {key: value for key, value in state.items() if ".lora_A." not in key and ".lora_B." not in key}
    for name, module in layers.items():
        out.update(module.merged_weights(name, state))
    return out


def save_hf_checkpoint(trainer: Any, path: str | Path, config: Any) -> None:
    """``--save-hf``: the HF checkpoint of the trainer's model; with LoRA the PEFT adapter
    (``--merge-lora``: the merged HF checkpoint instead)."""
    from miles_host.models import save_pretrained

    if getattr(trainer, "streams_weights", False) and not lora_modules(trainer.model):
        from miles_host.models.save_buckets import save_hf_in_buckets

        save_hf_in_buckets(trainer, path, int(config.update_weight_buffer_size))  # one shard per bucket
        return
    state = trainer.full_state_dict()  # a sharded trainer's gathered weights; None: the model's own are whole
    if not lora_modules(trainer.model):
        save_pretrained(trainer.model, path, state_dict=state)
    elif config.merge_lora:
        save_pretrained(trainer.model, path, state_dict=merged_state_dict(trainer.model, state))
    else:
        save_adapter(trainer.model, path, config, state)


def save_checkpoint_adapter(trainer: Any, folder: str | Path, config: Any) -> None:
    """Next to a ``--save`` checkpoint's state, the PEFT adapter (``<folder>/adapter``) of a
    LoRA run, so any checkpoint serves as a ``--lora-adapter-path``; nothing without LoRA."""
    if lora_modules(trainer.model):
        save_adapter(trainer.model, Path(folder) / "adapter", config, trainer.full_state_dict())
