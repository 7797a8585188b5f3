"""Weight names on the wire: SGLang speaks Hugging Face names.

The trainer hands out the native model's names (``model.state_dict()``); SGLang's
``load_weights`` takes HF checkpoint names. The client converts native -> HF with
the model family's adapter (so a real SGLang server understands the update), and
``miles serve`` converts back, accepting native names as well.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch


def family_and_config(model_path: str) -> tuple[Any, Any]:
    """The model-family record and native config of an HF checkpoint directory."""
    from miles_host.models.loading import default_family_lookup, native_config, read_hf_config

    hf = read_hf_config(model_path)
    family = default_family_lookup(hf["model_type"])
    return family, native_config(hf, family)


def native_to_hf(named: Iterable[tuple[str, torch.Tensor]], family: Any, config: Any) -> list[tuple[str, torch.Tensor]]:
    """Rename (and split fused tensors) to HF names with the family adapter."""
    out = []
    for name, tensor in named:
        if family.convert_native_tensor is not None:
            converted = family.convert_native_tensor(name, tensor, config)
            if converted is not None:
                out.extend(converted)
                continue
        out.append((family.native_to_hf(name) if family.native_to_hf is not None else name, tensor))
    return out


def _hf_targets(family: Any, name: str, tensor: torch.Tensor, config: Any) -> list[tuple[str, torch.Tensor, Any]]:
    if family.convert_hf_tensor is not None:
        converted = family.convert_hf_tensor(name, tensor, config)
        if converted is not None:
            return [entry if len(entry) == 3 else (*entry, None) for entry in converted]
    native = family.hf_to_native(name) if family.hf_to_native is not None else name
    return [] if native is None else [(native, tensor, None)]


@torch.no_grad()
def load_named_tensors(model: torch.nn.Module, named: Sequence[tuple[str, torch.Tensor]], family: Any) -> int:
    """Copy HF- or native-named tensors into ``model`` in place; return how many copies.

    Every name and shape is checked before anything is copied, so a bad update
    (ValueError naming the tensor) leaves the weights untouched.
    """
    from miles_host.rollout.weights import weight_targets

    targets = weight_targets(model)  # parameters, buffers and names modules load themselves (INT4 kernels)
    tied = getattr(model, "lm_head", 0) is None
    plan = []
    for name, tensor in named:
        pieces = [(name, tensor, None)] if name in targets else _hf_targets(family, name, tensor, model.config)
        for native, part, index in pieces:
            if native == "lm_head.weight" and tied:
                continue  # tied embeddings: lm_head is the embedding
            if native not in targets:
                raise ValueError(
                    f"weight {name!r} matches no parameter of the served model (neither a native name like "
                    f"{next(iter(targets))!r} nor an HF name its model family maps)"
                )
            target = targets[native]
            if not isinstance(target, torch.Tensor):  # a module's weight sink takes whole tensors only
                if index is not None:
                    raise ValueError(f"weight {name!r} -> {native!r}: a slice of a weight the module loads itself")
                destination = target
            else:
                destination = target.data if index is None else target.data[index]
            if tuple(destination.shape) != tuple(part.shape):
                raise ValueError(
                    f"weight {name!r} -> {native!r} has shape {tuple(part.shape)}, the model expects {tuple(destination.shape)}"
                )
            plan.append((destination, part))
    for destination, part in plan:
        destination.copy_(part.to(device=destination.device, dtype=destination.dtype))
    return len(plan)
