"""In-place weight updates of the engine's model.

Most weights are parameters or buffers and are updated with ``copy_``. A module
may instead claim some names with ``miles_weight_sinks() -> {suffix: WeightSink}``:
it then receives those tensors itself (an INT4 linear repacks them straight into
its kernel's layout and keeps no second copy). After every update each module's
``miles_weights_updated()`` runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch


@dataclass
class WeightSink:
    """A weight name a module loads itself: shape, dtype and device it expects, and the loader."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    load: Callable[[torch.Tensor], None]

    def copy_(self, tensor: torch.Tensor) -> "WeightSink":
        self.load(tensor)
        return self


def weight_targets(model: torch.nn.Module) -> dict[str, torch.Tensor | WeightSink]:
    """Every name a weight update may carry: parameters, buffers and claimed sinks."""
    targets: dict[str, torch.Tensor | WeightSink] = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    for prefix, module in model.named_modules():
        claim = getattr(module, "miles_weight_sinks", None)
        if callable(claim):
            for suffix, sink in claim().items():
                targets[f"{prefix}.{suffix}" if prefix else suffix] = sink
    return targets


@torch.no_grad()
def copy_named_tensors(
    model: torch.nn.Module, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
) -> int:
    """Copy tensors into the model's parameters/buffers (or sinks) of the same name; return how many.

    In place (``copy_``), so CUDA graphs captured over these tensors stay valid.
    Unknown names and shape mismatches are ``ValueError`` before anything is copied.
    """
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    targets = weight_targets(model)
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
