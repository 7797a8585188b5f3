"""Which weights INT4 quantizes (``--int4-target experts|all``).

One predicate on native parameter names and ranks, :func:`is_target`, decides
for the training model, the rollout model and weight sync alike (weight sync only
sees ``(name, tensor)`` pairs), so the three can never disagree:

- ``experts``: the stacked routed-expert weights ``*.experts.gate_up_proj [E, 2I, H]``
  and ``*.experts.down_proj [E, H, I]`` (grouped along their last, input dim).
- ``all``: those plus every 2-D linear ``*.weight`` except the output heads
  (``lm_head``, MTP ``head``), the MoE router and the shared-expert gate, and
  embeddings (which are not linears).
"""

from __future__ import annotations

from typing import Iterator

import torch

from miles_host.models.mlp import Experts

TARGETS = ("experts", "all")
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
#: owners of 2-D ``weight``s that stay in the model dtype under ``all``
KEEP_DENSE = ("lm_head", "head", "router", "shared_gate", "embed_tokens")


def is_target(name: str, ndim: int, target: str) -> bool:
    """Whether the native parameter ``name`` (of rank ``ndim``) is quantized under ``target``."""
    if target not in TARGETS:
        raise ValueError(f"--int4-target must be one of {TARGETS}, got {target!r}")
    parts = name.split(".")
    leaf, owner = parts[-1], (parts[-2] if len(parts) > 1 else "")
    if ndim == 3 and owner == "experts" and leaf in EXPERT_PARAMS:
        return True
    return target == "all" and ndim == 2 and leaf == "weight" and owner not in KEEP_DENSE


def target_parameters(model: torch.nn.Module, target: str) -> Iterator[tuple[str, torch.nn.Module, str]]:
    """``(module_name, module, param_name)`` of every quantized parameter of ``model``."""
    for module_name, module in list(model.named_modules()):
        for param_name, param in list(module.named_parameters(recurse=False)):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if not is_target(full, param.dim(), target):
                continue
            if not isinstance(module, (torch.nn.Linear, Experts)):
                raise ValueError(
                    f"int4: {full} {tuple(param.shape)} looks like a linear weight by its name but belongs to a "
                    f"{type(module).__name__}; miles-int4 quantizes torch.nn.Linear and MoE Experts only"
                )
            yield module_name, module, param_name
