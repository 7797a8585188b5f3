"""Flags of LoRA training, upstream miles' spellings and defaults (``--lora-rank 0``: off).

The policy's chosen linears get low-rank adapters (:mod:`miles_host.lora`); the base stays
frozen. Module names are PEFT's (the HF model's), e.g. ``q_proj,v_proj``, or ``all-linear``.
``--lora-sync`` is this host's own flag (upstream's SGLang engines always serve the adapter
separately): merged weights at each sync, or the adapters alone over an untouched base.
:func:`miles_host.lora.checks.check_lora` checks the values and combinations.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles_host.config_fields import flag


@dataclass
class LoraArgs:
    lora_rank: int = flag(0, "LoRA rank of the policy's adapters; 0: LoRA off (the whole model trains)", type=int, group="lora")
    lora_alpha: int = flag(16, "LoRA alpha: the adapters' update is scaled by alpha / rank", type=int, group="lora")
    lora_dropout: float = flag(0.0, "dropout on the adapters' input (training forward only)", type=float, group="lora")
    target_modules: str | None = flag(None, "modules that get adapters, comma-separated PEFT (HF) names such as q_proj,v_proj, full module paths, upstream's Megatron names (linear_qkv, linear_proj, linear_fc1, linear_fc2), or all-linear (the default; with --lora-adapter-path: the adapter's modules). Routed MoE experts (stacked 3-D weights, saved as PEFT's target_parameters) are included by all-linear and picked by gate_up_proj (or gate_proj with up_proj), down_proj, experts.gate_up_proj, experts.down_proj, or experts (both stacks); --exclude-modules experts leaves them out", type=str, group="lora")
    exclude_modules: str | None = flag(None, "modules of --target-modules that get no adapter (comma-separated, names as --target-modules)", type=str, group="lora")
    lora_adapter_path: str | None = flag(None, "start from this PEFT adapter directory (adapter_config.json + adapter_model.safetensors; its r and lora_alpha must be --lora-rank and --lora-alpha)", type=str, group="lora")
    merge_lora: bool = flag(False, "with --save-hf: write the merged HF checkpoint (W + alpha/r * B @ A) instead of the PEFT adapter", group="lora")
    lora_sync: str = flag("merged", "how the rollout engine applies the adapters. merged: every weight sync sends the merged weights W + alpha/r * B @ A (plain GEMMs at decode, the whole model moves each sync). adapter: the engine keeps the base weights untouched and runs the adapters as separate low-rank GEMMs (W x + alpha/r * B (A x)); the first sync sends the base and adapters, every later one only the lora_A / lora_B tensors (embedded and process engines)", type=str, choices=("merged", "adapter"), group="lora")
