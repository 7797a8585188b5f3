"""Finding a model's LoRA layers: adapted linears (:mod:`miles_host.lora.layers`) and routed
experts (:mod:`miles_host.lora.experts`)."""

from __future__ import annotations

import torch

from miles_host.lora.experts import LoraExperts
from miles_host.lora.layers import LoraAdapters


def lora_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's LoRA layers (:class:`LoraLinear`, adapted quantized linears and routed experts:
    :class:`~miles_host.lora.experts.LoraExperts`) by module name (empty: the model carries no
    adapters). Each has ``parts``, ``rank``, ``alpha``, ``scaling``, ``lora_A`` / ``lora_B``,
    ``fuse_adapters()`` and ``merged_weights(name, state)``."""
    return {name: module for name, module in model.named_modules() if isinstance(module, (LoraAdapters, LoraExperts))}
