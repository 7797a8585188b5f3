"""PEFT's adapter format: ``adapter_config.json`` + ``adapter_model.safetensors``.

Keys are PEFT's, ``base_model.model.<HF module path>.lora_A.weight`` (``[r, in]``) and
``...lora_B.weight`` (``[out, r]``), so ``peft.PeftModel.from_pretrained`` loads a miles
adapter onto the transformers model, and miles loads an adapter PEFT wrote. Adapters on the
routed experts' stacks are PEFT's ``target_parameters`` (``lora.ParamWrapper``; layout and key
names: :mod:`miles_host.lora.experts`). Only plain LoRA
is read: one rank and alpha for the linears (a ``rank_pattern`` / ``alpha_pattern`` may give the
expert stacks their own, as PEFT >= 0.22 does for the fused ``gate_up_proj``), no DoRA, no
rsLoRA, no trained biases or extra saved modules (each is refused by name).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import torch

from miles_host.lora.experts import LoraExperts, PeftLayout, peft_layout
from miles_host.lora.modules import lora_modules
from miles_host.lora.targets import candidates_of, matches

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def peft_places(model: torch.nn.Module) -> dict[str, tuple[str, PeftLayout]]:
    """PEFT key -> (native name of the adapter matrix, its :class:`PeftLayout`) for every
    adapter matrix of ``model``."""
    out = {}
    for name, module in lora_modules(model).items():
        if isinstance(module, LoraExperts):
            for local, layout in peft_layout(module, _PREFIX).items():
                out[layout.key] = (f"{name}.{local}", layout)
            continue
        for part in module.parts:
            for matrix in ("A", "B"):
                key = f"{_PREFIX}{part.hf_module}.lora_{matrix}.weight"
                out[key] = (f"{name}.lora_{matrix}.{part.key}", PeftLayout(key, _same, _same))
    return out


def adapter_tensors(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """PEFT-named adapter tensors of ``model`` (from ``state``, a native state dict such as a
    sharded trainer's gathered one, when given), float32 on the CPU."""
    state = state if state is not None else model.state_dict()
    return {key: layout.to_peft(state[native].detach()).float().cpu().contiguous()
            for key, (native, layout) in peft_places(model).items()}


def _picking_names(adapted: list[str], every: list[str], leaf: Any) -> list[str]:
    """The shortest names (``leaf(path)``) that pick exactly the ``adapted`` paths out of
    ``every``, else the full paths."""
    leaves = sorted({leaf(path) for path in adapted})
    picked = [p for p in every if leaf(p) in leaves]
    return leaves if sorted(picked) == sorted(adapted) else sorted(adapted)


def adapter_config(model: torch.nn.Module, config: Any) -> dict[str, Any]:
    """PEFT's ``LoraConfig`` fields for the adapters of ``model``. ``target_modules`` (linears)
    and ``target_parameters`` (routed experts' stacks) are the leaf names (``q_proj``,
    ``experts.gate_up_proj``) when they pick exactly the adapted ones, else the full paths.

    On a model with routed-expert stacks the linears are named with their parent module
    (``shared_expert.gate_proj``, ``self_attn.q_proj``): PEFT >= 0.22 reads a bare ``gate_proj``
    / ``up_proj`` / ``down_proj`` there as transformers v4's per-expert projection and would also
    target the fused stack (``gate_up_proj`` at twice the rank), which this adapter does not hold."""
    modules = list(lora_modules(model).values())
    first = modules[0]
    rank_pattern, alpha_pattern = stack_patterns(model, (first.rank, first.alpha))
    candidates = candidates_of(model)
    linears = [p.hf_module for m in modules if not isinstance(m, LoraExperts) for p in m.parts]
    stacks = [p.hf_module for m in modules if isinstance(m, LoraExperts) for p in m.parts]
    has_stacks = any(c.experts for c in candidates)
    targets = _picking_names(linears, [c.part.hf_module for c in candidates if not c.experts],
                             _last(2 if has_stacks else 1)) if linears else None
    parameters = _picking_names(stacks, [c.part.hf_module for c in candidates if c.experts], _last(2)) \
        if stacks else None
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": config.hf_checkpoint,
        "r": first.rank,
        "lora_alpha": first.alpha,
        "lora_dropout": float(config.lora_dropout),
        "target_modules": targets,
        "target_parameters": parameters,
        "exclude_modules": None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
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


def _last(parts: int) -> Callable[[str], str]:
    return lambda path: ".".join(path.rsplit(".", parts)[-parts:])


def pattern_value(patterns: dict[str, Any] | None, key: str, default: Any) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: the value of the first pattern that
    matches a dotted suffix of ``key`` (``re.match(rf"(.*\\.)?({pattern})$", key)``), else ``default``."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def adapter_shape(adapter: dict[str, Any], hf_path: str) -> tuple[int, float]:
    """(rank, alpha) a PEFT adapter config gives the module or stacked parameter ``hf_path``."""
    return (pattern_value(adapter.get("rank_pattern"), hf_path, adapter.get("r")),
            pattern_value(adapter.get("alpha_pattern"), hf_path, adapter.get("lora_alpha")))


def stack_patterns(model: torch.nn.Module, default: tuple[int, float]) -> tuple[dict[str, int], dict[str, float]]:
    """``rank_pattern`` and ``alpha_pattern`` for the expert stacks of ``model`` whose (rank,
    alpha) are not ``default``: one entry per stack name (``experts\\.gate_up_proj``) where all
    its stacks agree, else one per stack path."""
    shapes: dict[str, tuple[int, float]] = {}
    for module in lora_modules(model).values():
        if isinstance(module, LoraExperts):
            for part in module.parts:
                shapes[part.hf_module] = (module.ranks[part.key], module.alphas[part.key])
    by_name: dict[str, set[tuple[int, float]]] = {}
    for path, shape in shapes.items():
        by_name.setdefault(_last(2)(path), set()).add(shape)
    ranks, alphas = {}, {}
    for path, shape in sorted(shapes.items()):
        uniform = len(by_name[_last(2)(path)]) == 1
        if shape == default:
            continue
        key = re.escape(_last(2)(path) if uniform else path)
        if shape[0] != default[0]:
            ranks[key] = shape[0]
        if shape[1] != default[1]:
            alphas[key] = shape[1]
    return ranks, alphas


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
        "bias": (adapter.get("bias", "none") != "none", "trained biases are not supported"),
        "modules_to_save": (bool(adapter.get("modules_to_save")), "fully trained extra modules are not supported"),
    }
    for field, (bad, why) in refusals.items():
        if bad:
            raise ValueError(f"--lora-adapter-path {path}: {field} = {adapter.get(field)!r}: {why}; "
                             "miles loads plain LoRA adapters")
    return adapter


def adapter_modules(path: str | Path, stack_paths: set[str]) -> list[str]:
    """The HF paths an adapter file holds LoRA pairs for: linear modules, and the stacked
    parameters its ``target_parameters`` adapt (``<experts module>.gate_up_proj``), told apart
    by the model's expert stacks ``stack_paths`` (PEFT keys both as ``<module>.lora_A.weight``)."""
    from safetensors import safe_open

    with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt", device="cpu") as handle:
        keys = list(handle.keys())
    modules = {k[len(_PREFIX):].rsplit(".lora_", 1)[0].replace(".base_layer", "")
               for k in keys if k.startswith(_PREFIX) and ".lora_" in k}
    parameters = read_adapter_config(path).get("target_parameters") or []
    stacks = {f"{module}.{target.rsplit('.', 1)[-1]}" for module in modules for target in parameters
              if f"{module}.{target.rsplit('.', 1)[-1]}" in stack_paths
              and matches(f"{module}.{target.rsplit('.', 1)[-1]}", target)}
    wrapped = {stack.rsplit(".", 1)[0] for stack in stacks}
    return sorted((modules - wrapped) | stacks)


def load_adapter(model: torch.nn.Module, path: str | Path) -> None:
    """Copy a PEFT adapter's A and B matrices into ``model``'s LoRA layers.

    ValueError names every tensor that has no place in the model, every adapted module the
    file lacks, and shape mismatches."""
    from safetensors.torch import load_file

    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        raise FileNotFoundError(f"--lora-adapter-path {path}: no {WEIGHTS_FILE} there")
    tensors = load_file(str(file))
    places = peft_places(model)
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
        for key, (native, layout) in places.items():
            destination = model.get_parameter(native)
            expected = tuple(layout.to_peft(destination).shape)
            if expected != tuple(tensors[key].shape):
                raise ValueError(f"--lora-adapter-path {path}: {key} has shape {tuple(tensors[key].shape)}, the "
                                 f"model's LoRA layer expects {expected}")
            destination.copy_(layout.from_peft(tensors[key]))
