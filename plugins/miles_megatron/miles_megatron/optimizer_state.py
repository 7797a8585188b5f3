"""The megatron trainer's Adam state in ``--ckpt-format torch`` checkpoints, on any layout.

The state is that of Megatron-Core's ``FP32Optimizer`` torch optimizers, keyed by the
model's parameters (``trainer.optimizer.state``,
:class:`~miles_megatron.megatron_optimizer.InnerState`). The moments of each parameter have
its shape, so they are gathered and split exactly as the weights are
(:func:`~miles_megatron.parallel.full_state`, :func:`~miles_megatron.parallel.rank_state`:
TP/EP shards, PP stages renumbered to global layers; nothing to gather in one process) and
stored under native names:
``{"moments": {"exp_avg": {native name: full tensor}, "exp_avg_sq": {...}},
"step": float, "param_groups": [{"lr": ..., ...}]}`` (the learning rate of the next step).
Under PP with tied embeddings the last stage's copy of the embedding has the same moments
as the first stage's (their gradients are summed over both), so it is dropped on save and
loaded from the embedding's. A checkpoint written with one layout loads into a trainer of
any other.
"""

from __future__ import annotations

from typing import Any

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")
#: what a checkpoint keeps of the optimizer's parameter group: the learning rate the schedule set
#: (the other settings are the flags')
_SCHEDULED = ("lr", "initial_lr")


def _named_params(chunk: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, param) for name, param in chunk.named_parameters() if param.requires_grad]


def gather_optimizer_state(trainer: Any) -> dict | None:
    """A collective of every rank; rank 0 gets the full state, the others ``None``."""
    from miles_megatron.parallel import full_state_of_chunks
    from miles_megatron.runtime import on_device
    from miles_megatron.weights import megatron_to_native

    optimizer = trainer.optimizer
    chunks = trainer.model.chunks  # (one model chunk each under virtual pipeline stages)
    step = 0.0
    moments: dict[str, dict[str, torch.Tensor]] = {}
    with on_device(trainer.device):
        for key in MOMENTS:
            locals_ = []
            for chunk in chunks:
                local = {}
                for name, param in _named_params(chunk):
                    state = optimizer.state.get(param, {})
                    if "step" in state:
                        step = float(state["step"])
                    local[name] = state[key].detach() if key in state else torch.zeros_like(param)
                locals_.append(local)
            full = full_state_of_chunks(locals_, chunks, trainer.model.config.vocab_size)
            moments[key] = megatron_to_native(full, trainer.model.config) if trainer.rank == 0 else {}
    if trainer.rank != 0:
        return None
    groups = [{k: v for k, v in group.items() if k in _SCHEDULED} for group in optimizer.param_groups]
    return {"moments": moments, "step": step, "param_groups": groups}


def load_optimizer_state(trainer: Any, saved: dict) -> None:
    """This rank's part of :func:`gather_optimizer_state`'s result."""
    from miles_megatron.parallel import rank_state
    from miles_megatron.weights import native_to_megatron

    optimizer = trainer.optimizer
    config = trainer.model.config
    full = {key: native_to_megatron(saved["moments"][key], config) for key in MOMENTS}
    for chunk in trainer.model.chunks:
        shards = {key: rank_state(full[key], chunk, config.vocab_size) for key in MOMENTS}
        for name, param in _named_params(chunk):
            state = {"step": optimizer.state.step_counter(param, saved["step"])}
            for key in MOMENTS:
                state[key] = shards[key][name].to(device=param.device, dtype=param.dtype).clone()
            optimizer.state[param] = state
    for group, values in zip(optimizer.param_groups, saved["param_groups"]):
        group.update({k: v for k, v in values.items() if k in _SCHEDULED})
