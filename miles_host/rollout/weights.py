"""In-place weight updates of the engine's model."""

from __future__ import annotations

from typing import Iterable, Mapping

import torch


@torch.no_grad()
def copy_named_tensors(
    model: torch.nn.Module, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
) -> int:
    """Copy tensors into the model's parameters/buffers of the same name; return how many.

    In place (``copy_``), so CUDA graphs captured over these tensors stay valid.
    Unknown names and shape mismatches are ``ValueError`` before anything is copied.
    """
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    unknown = [name for name, _ in items if name not in targets]
    if unknown:
        raise ValueError(
            f"update_weights got {len(unknown)} names the model does not have, e.g. {unknown[:3]}; "
            f"expected names like {list(targets)[:3]} (the model's state_dict names)"
        )
    for name, tensor in items:
        if tuple(tensor.shape) != tuple(targets[name].shape):
            raise ValueError(
                f"update_weights: {name} has shape {tuple(tensor.shape)}, the model expects {tuple(targets[name].shape)}"
            )
    for name, tensor in items:
        targets[name].copy_(tensor.to(device=targets[name].device, dtype=targets[name].dtype))
    for module in model.modules():  # e.g. INT4 linears repack their kernel copies in place
        refresh = getattr(module, "miles_weights_updated", None)
        if callable(refresh):
            refresh()
    return len(items)
