"""PEFT's adapter format: ``adapter_config.json`` + ``adapter_model.safetensors``.

Keys are PEFT's, ``base_model.model.<HF module path>.lora_A.weight`` (``[r, in]``) and
``...lora_B.weight`` (``[out, r]``), so ``peft.PeftModel.from_pretrained`` loads a miles
adapter onto the transformers model, and miles loads an adapter PEFT wrote. Only plain LoRA
is read: one rank and alpha for all modules, no DoRA, no rsLoRA, no trained biases or
extra saved modules (each is refused by name).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from miles_host.lora.layers import LoraLinear, lora_modules
from miles_host.lora.targets import candidates_of

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def adapter_tensors(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """PEFT-named adapter tensors of ``model`` (from ``state``, a native state dict such as a
    sharded trainer's gathered one, when given), float32 on the CPU."""
    state = state if state is not None else model.state_dict()
    out = {}
    for name, module in lora_modules(model).items():
        for part in module.parts:
            for matrix in ("A", "B"):
                tensor = state[f"{name}.lora_{matrix}.{part.key}"]
                out[f"{_PREFIX}{part.hf_module}.lora_{matrix}.weight"] = tensor.detach().float().cpu().contiguous()
    return out


def adapter_config(model: torch.nn.Module, config: Any) -> dict[str, Any]:
    """PEFT's ``LoraConfig`` fields for the adapters of ``model``. ``target_modules`` is the
    leaf names when they pick exactly the adapted modules, else the full module paths."""
    modules = list(lora_modules(model).values())
    first = modules[0]
    adapted = [p.hf_module for m in modules for p in m.parts]
    every = [c.part.hf_module for c in candidates_of(model)]
    leaves = sorted({path.rsplit(".", 1)[-1] for path in adapted})
    picked_by_leaves = [p for p in every if p.rsplit(".", 1)[-1] in leaves]
    targets = leaves if sorted(picked_by_leaves) == sorted(adapted) else sorted(adapted)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": config.hf_checkpoint,
        "r": first.rank,
        "lora_alpha": first.alpha,
        "lora_dropout": float(config.lora_dropout),
        "target_modules": targets,
        "exclude_modules": None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "rank_pattern": {},
        "alpha_pattern": {},
        "layers_to_transform": None,
        "layers_pattern": None,
    }


def save_adapter(model: torch.nn.Module, path: str | Path, config: Any,
                 state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the PEFT adapter of ``model`` to directory ``path``; returns it."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(adapter_tensors(model, state), str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(adapter_config(model, config), indent=2, sort_keys=True) + "\n")
    return path


def read_adapter_config(path: str | Path) -> dict[str, Any]:
    """``adapter_config.json`` of a PEFT adapter directory, checked to be plain LoRA."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"--lora-adapter-path {path}: no {CONFIG_FILE} there (not a PEFT adapter directory?)")
    try:
        adapter = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from exc
    refusals = {
        "peft_type": (adapter.get("peft_type", "LORA") != "LORA", "is not LORA"),
        "use_dora": (bool(adapter.get("use_dora")), "DoRA adapters are not supported"),
        "use_rslora": (bool(adapter.get("use_rslora")), "rsLoRA scaling (alpha / sqrt(r)) is not supported"),
        "rank_pattern": (bool(adapter.get("rank_pattern")), "per-module ranks are not supported"),
        "alpha_pattern": (bool(adapter.get("alpha_pattern")), "per-module alphas are not supported"),
        "bias": (adapter.get("bias", "none") != "none", "trained biases are not supported"),
        "modules_to_save": (bool(adapter.get("modules_to_save")), "fully trained extra modules are not supported"),
    }
    for field, (bad, why) in refusals.items():
        if bad:
            raise ValueError(f"--lora-adapter-path {path}: {field} = {adapter.get(field)!r}: {why}; "
                             "miles loads plain LoRA adapters (one r and lora_alpha for all modules)")
    return adapter


def adapter_modules(path: str | Path) -> list[str]:
    """The HF module paths an adapter file holds LoRA pairs for."""
    from safetensors import safe_open

    with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt", device="cpu") as handle:
        keys = list(handle.keys())
    return sorted({k[len(_PREFIX):].rsplit(".lora_", 1)[0] for k in keys if k.startswith(_PREFIX) and ".lora_" in k})


def load_adapter(model: torch.nn.Module, path: str | Path) -> None:
    """Copy a PEFT adapter's A and B matrices into ``model``'s LoRA layers.

    ValueError names every tensor that has no place in the model, every adapted module the
    file lacks, and shape mismatches."""
    from safetensors.torch import load_file

    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        raise FileNotFoundError(f"--lora-adapter-path {path}: no {WEIGHTS_FILE} there")
    tensors = load_file(str(file))
    places: dict[str, tuple[LoraLinear, str, str]] = {}
    for module in lora_modules(model).values():
        for part in module.parts:
            for matrix in ("A", "B"):
                places[f"{_PREFIX}{part.hf_module}.lora_{matrix}.weight"] = (module, matrix, part.key)
    unexpected = sorted(set(tensors) - set(places))
    missing = sorted(set(places) - set(tensors))
    if unexpected or missing:
        problems = [f"{label} ({len(names)}): {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
                    for label, names in (("tensors with no LoRA layer here", unexpected),
                                         ("LoRA layers the file lacks", missing)) if names]
        raise ValueError(f"--lora-adapter-path {path} does not fit the adapted modules: {'; '.join(problems)}; "
                         "give --target-modules / --exclude-modules that pick the adapter's modules (or leave "
                         "--target-modules out to take the adapter's own)")
    with torch.no_grad():
        for key, (module, matrix, part_key) in places.items():
            destination = (module.lora_A if matrix == "A" else module.lora_B)[part_key]
            if tuple(destination.shape) != tuple(tensors[key].shape):
                raise ValueError(f"--lora-adapter-path {path}: {key} has shape {tuple(tensors[key].shape)}, the "
                                 f"model's LoRA layer expects {tuple(destination.shape)}")
            destination.copy_(tensors[key])
