"""Moving tensors between the device and host memory between RL phases.

Used by ``--offload-train`` (a trainer's parameters, gradients and optimizer state go
to CPU during rollout) and ``--offload-rollout`` (an engine's weights go to CPU during
training). Tensors keep their identity where PyTorch allows it: ``Module._apply``
re-points parameters (``param.data``, or ``swap_tensors`` for FSDP2's DTensors) and
gradients in place, so an optimizer's references stay valid.

Every move makes a new copy, also when source and target are both the CPU: the old
storage is freed and, on a CPU-only machine, tests can see that the move happened.
Device-to-host copies go to pinned memory (asynchronous; one synchronisation at the end).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch


def _plain(tensor: torch.Tensor) -> bool:
    return type(tensor) in (torch.Tensor, torch.nn.Parameter)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``tensor`` (pinned when it comes from a GPU)."""
    if tensor.is_cuda and _plain(tensor):
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host
    return tensor.to("cpu", copy=True)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``tensor`` on ``device``."""
    return tensor.to(device, copy=True, non_blocking=tensor.is_pinned() if _plain(tensor) else False)


def settle(device: torch.device | str | None) -> None:
    """Wait for the copies queued on ``device``; hand the freed device memory back to the driver."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


@torch.no_grad()
def move_modules(modules: Iterable[torch.nn.Module | None], device: torch.device | str) -> None:
    """Parameters, gradients and buffers of ``modules`` to ``device`` (CPU: pinned host copies)."""
    device = torch.device(device)
    fn = to_host if device.type == "cpu" else (lambda t: to_device(t, device))
    for module in modules:
        if module is not None:
            module._apply(fn)


@torch.no_grad()
def move_optimizer_state(optimizer: torch.optim.Optimizer | None, device: torch.device | str) -> None:
    """Every tensor of ``optimizer.state`` (Adam moments, step counts) to ``device``; a
    non-fused Adam's ``step`` counters live on the CPU by design and stay there."""
    if optimizer is None:
        return
    device = torch.device(device)
    cpu_steps = not any(group.get("fused") or group.get("capturable") for group in optimizer.param_groups)
    for state in optimizer.state.values():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or (key == "step" and cpu_steps and device.type != "cpu"):
                continue
            state[key] = to_host(value) if device.type == "cpu" else to_device(value, device)


# -- a trainer's state ----------------------------------------------------------------


def train_modules(trainer: Any) -> list[torch.nn.Module]:
    """The modules a native-style trainer holds: policy, reference model, critic."""
    return [m for m in (getattr(trainer, "model", None), getattr(trainer, "ref_model", None),
                        getattr(trainer, "critic", None)) if m is not None]


def train_optimizers(trainer: Any) -> list[torch.optim.Optimizer]:
    critic = getattr(trainer, "critic", None)
    return [o for o in (getattr(trainer, "optimizer", None), getattr(critic, "optimizer", None)) if o is not None]


def offload_train_state(trainer: Any) -> None:
    """Parameters, gradients and optimizer state of ``trainer`` to CPU (idempotent)."""
    if trainer.train_state_offloaded:
        return
    move_modules(train_modules(trainer), "cpu")
    for optimizer in train_optimizers(trainer):
        move_optimizer_state(optimizer, "cpu")
    trainer.train_state_offloaded = True
    settle(trainer.device)


def onload_train_state(trainer: Any) -> None:
    """Back to ``trainer.device`` after :func:`offload_train_state` (no-op otherwise)."""
    if not trainer.train_state_offloaded:
        return
    move_modules(train_modules(trainer), trainer.device)
    for optimizer in train_optimizers(trainer):
        move_optimizer_state(optimizer, trainer.device)
    trainer.train_state_offloaded = False
    settle(trainer.device)


def empty_device_cache(device: torch.device | str | None) -> None:
    """Return the caching allocator's free blocks to the device (for a colocated engine)."""
    settle(device)
