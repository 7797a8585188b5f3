"""Validation of the LoRA flags (a host check: it reads the training backend's record).

A quantized ``--precision`` (``int4``, ``fp8``) takes ``--lora-sync adapter`` only: the adapters
run next to the engine's quantized linears instead of being merged into re-quantized weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_host.config_fields import flag_name

#: flags that mean nothing while --lora-rank is 0
_NEEDS_RANK = ("target_modules", "exclude_modules", "lora_adapter_path", "merge_lora")


def check_lora(config: Any, registries: Any) -> None:
    """ValueError / FileNotFoundError naming the flag for LoRA settings a run cannot honour."""
    if config.lora_rank < 0:
        raise ValueError(f"--lora-rank must be >= 0 (0: LoRA off), got {config.lora_rank}")
    if config.lora_rank == 0:
        given = [flag_name(name) for name in _NEEDS_RANK if getattr(config, name)]
        given += [f"--lora-sync {config.lora_sync}"] if config.lora_sync != "merged" else []
        if given:
            raise ValueError(f"{', '.join(given)} configure LoRA, which --lora-rank 0 turns off; give --lora-rank N "
                             "(e.g. 16), or drop them")
        return
    if config.lora_alpha <= 0:
        raise ValueError(f"--lora-alpha must be positive (the update is scaled by alpha / rank), got {config.lora_alpha}")
    if not 0 <= config.lora_dropout < 1:
        raise ValueError(f"--lora-dropout must be in [0, 1), got {config.lora_dropout:g}")
    backend = registries.train_backends.get(config.train_backend)
    if not backend.lora:
        raise ValueError(f"--lora-rank {config.lora_rank}: --train-backend {config.train_backend} does not train LoRA "
                         "adapters (its models have no adapter layers); use --train-backend native, native_dp or fsdp, "
                         "or --lora-rank 0")
    if config.true_on_policy:
        raise ValueError("--true-on-policy with --lora-rank: the trainer computes W x + B (A x) while the engine "
                         "runs the merged weights (W + B A) x (--lora-sync merged) or its own decode kernels over "
                         "the adapters (--lora-sync adapter), so their log-probs are not bitwise equal; drop one")
    _check_sync(config)
    from miles_host.lora.sync import MODES

    default_precision = type(config).__dataclass_fields__["precision"].default
    if config.precision != default_precision and not MODES[config.lora_sync].engine_adapters:
        raise ValueError(f"--lora-rank {config.lora_rank} with --precision {config.precision} needs --lora-sync "
                         f"adapter: the engine keeps the quantized base weights (quantized once, never re-sent) and "
                         f"runs the adapters as separate low-rank GEMMs next to them (QLoRA-style); merged weights "
                         f"would be re-quantized and re-sent at every sync. Add --lora-sync adapter (or use "
                         f"--precision {default_precision})")
    if config.merge_lora and not config.save_hf:
        raise ValueError("--merge-lora chooses what --save-hf writes (merged weights instead of the adapter); add "
                         "--save-hf DIR, or drop --merge-lora")
    if config.lora_adapter_path:
        path = Path(config.lora_adapter_path)
        if not (path / "adapter_config.json").is_file() or not (path / "adapter_model.safetensors").is_file():
            raise FileNotFoundError(f"--lora-adapter-path {path}: needs adapter_config.json and "
                                    "adapter_model.safetensors there (a PEFT adapter directory)")
        from miles_host.lora.inject import check_adapter_shape

        check_adapter_shape(config)
    if config.hf_checkpoint and (config.lora_adapter_path or config.lora_dropout):
        from miles_host.lora.inject import checkpoint_candidates, refuse_expert_dropout, stack_shapes

        chosen = checkpoint_candidates(config)  # the model on the meta device, built once
        stack_shapes(chosen, config)
        refuse_expert_dropout(sorted({c.native for c in chosen if c.experts}), config)


def _check_sync(config: Any) -> None:
    """``--lora-sync``: a known mode; ``adapter`` needs an engine running this host's model code."""
    from miles_host.lora.sync import ADAPTER_ENGINE_BACKENDS, MODES

    if config.lora_sync not in MODES:
        raise ValueError(f"--lora-sync {config.lora_sync!r}: choose one of {', '.join(MODES)}")
    if MODES[config.lora_sync].engine_adapters and config.rollout_backend not in ADAPTER_ENGINE_BACKENDS:
        raise ValueError(f"--lora-sync {config.lora_sync} with --rollout-backend {config.rollout_backend}: only the "
                         f"{' and '.join(ADAPTER_ENGINE_BACKENDS)} engines carry the adapters as separate layers "
                         "(SGLang servers would need --enable-lora and adapter loading, which miles does not drive); "
                         "use --lora-sync merged or --rollout-backend embedded")
