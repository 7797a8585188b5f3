"""LoRA training of the policy, interoperable with PEFT.

- :mod:`~miles_host.lora.layers`: :class:`LoraLinear`, adapters on the row slices of a fused linear;
  adapters next to a precision recipe's quantized linears (``adapt_in_place``)
- :mod:`~miles_host.lora.targets`: the adaptable HF linears and PEFT's name matching
- :mod:`~miles_host.lora.experts`: :class:`LoraExperts`, adapters on the routed experts' stacked
  weights (PEFT's ``target_parameters``)
- :mod:`~miles_host.lora.inject`: :func:`apply_lora`, what the trainer calls after loading the policy
- :mod:`~miles_host.lora.export`: merged weights for weight sync, ``--save-hf`` and checkpoint output
- :mod:`~miles_host.lora.sync`: ``--lora-sync``: merged weights, or adapters run unmerged by the engine
- :mod:`~miles_host.lora.peft_io`: PEFT's adapter files, both ways
- :mod:`~miles_host.lora.checks`: validation of the flags (:mod:`miles_host.config_lora`)
"""

from miles_host.lora.export import merged_state_dict, save_checkpoint_adapter, save_hf_checkpoint
from miles_host.lora.inject import LoraSummary, apply_lora
from miles_host.lora.layers import LoraLinear, LoraPart
from miles_host.lora.modules import lora_modules
from miles_host.lora.peft_io import load_adapter, save_adapter

__all__ = [
    "LoraLinear",
    "LoraPart",
    "LoraSummary",
    "apply_lora",
    "load_adapter",
    "lora_modules",
    "merged_state_dict",
    "save_adapter",
    "save_checkpoint_adapter",
    "save_hf_checkpoint",
]
