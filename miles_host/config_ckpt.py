"""Flags of Megatron-format checkpoints, Megatron-LM's / slime's spellings and defaults.

``--ckpt-format`` says how a training backend that keeps its model in shards writes
``--save`` checkpoints: ``torch_dist`` (Megatron's default: every rank writes its own
shards with ``megatron.core.dist_checkpointing``, readable on another layout), or
``torch`` (the whole state gathered into the host's ``state.pt``). The native trainers
always write ``state.pt``. ``--no-save-optim`` / ``--no-load-optim`` leave the
optimizer state out of what is saved / loaded (slime's: a smaller checkpoint that
resumes with fresh optimizer moments).
"""

from __future__ import annotations

from dataclasses import dataclass

from miles_host.config_fields import flag


@dataclass
class CheckpointFormatArgs:
    ckpt_format: str = flag("torch_dist", "checkpoint format of a sharded training backend (--train-backend megatron): torch_dist, each rank writes its own shards (megatron.core.dist_checkpointing; loads on another TP/PP layout), or torch, the state gathered into one file", type=str, choices=("torch_dist", "torch"), group="checkpoint")
    no_save_optim: bool = flag(False, "do not save the optimizer state in --save checkpoints (a resume starts with fresh optimizer moments)", group="checkpoint")
    no_load_optim: bool = flag(False, "do not load the optimizer state from --load (fresh optimizer moments)", group="checkpoint")
