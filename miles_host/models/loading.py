"""Load and save HF-format checkpoints through a model-family adapter.

``load_pretrained`` reads ``config.json``, finds the family that handles its
``model_type``, builds the native module on the meta device, allocates it once
on the target device, and streams safetensors shards into it tensor by tensor
(each HF tensor is copied straight into its slice of the native parameter: no
second full copy). ``save_pretrained`` writes ``config.json`` (the original HF
dict, all fields kept) and safetensors shards in HF names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from miles_host.models.config import ModelConfig
from miles_host.models.gemma3n import Gemma3nCausalLM
from miles_host.models.mlp import Router
from miles_host.models.model import CausalLM
from miles_host.routing import NO_ROUTING_HOOKS, RoutingHooks

FamilyLookup = Callable[[str], Any]
_MAX_LISTED = 20


def default_family_lookup(model_type: str) -> Any:
    """The registered family for ``model_type`` (ValueError names it and lists supported types)."""
    from miles_host.plugin_manager import model_family_for

    return model_family_for(model_type)


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` of a checkpoint directory as a dict."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: load_pretrained needs an HF checkpoint directory")
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_file} is not valid JSON: {exc}") from exc
    if "model_type" not in hf:
        raise ValueError(f"{config_file} has no 'model_type'; cannot tell which model family to use")
    return hf


def native_config(hf: dict[str, Any], family: Any) -> ModelConfig:
    """The family's native config for an HF config dict (keeps the dict on it)."""
    try:
        config = family.config_from_hf(hf)
    except KeyError as exc:
        raise ValueError(
            f"config.json of model_type {hf.get('model_type')!r} lacks the required field {exc.args[0]!r}"
        ) from exc
    if not config.hf_config:
        config.hf_config = dict(hf)
    return config


def safetensors_files(path: str | Path) -> list[Path]:
    """The weight files of a checkpoint: single file or the shards of the index."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ValueError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that do not exist: {missing}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` one tensor at a time; corrupt files, and tensors holding NaN
    or infinity, raise naming the file and the tensor."""
    from safetensors import safe_open

    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
            names = list(handle.keys())
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types
            raise ValueError(f"corrupt or unreadable safetensors file {file}: {exc}") from exc
        for name in names:
            try:
                tensor = handle.get_tensor(name)
            except Exception as exc:  # noqa: BLE001
                raise ValueError(f"corrupt safetensors file {file}: cannot read tensor {name!r}: {exc}") from exc
            if not all_finite(tensor):
                raise ValueError(
                    f"{file}: tensor {name!r} holds NaN or infinite values; the checkpoint is damaged or was saved "
                    "from a diverged run (use an earlier checkpoint)"
                )
            yield name, tensor


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in a floating-point tensor (other dtypes: always True)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    readable = tensor if tensor.element_size() > 1 else tensor.float()  # no isfinite kernels for float8
    return bool(torch.isfinite(readable).all())


def _native_targets(family: Any, name: str, tensor: torch.Tensor, config: ModelConfig):
    if family.convert_hf_tensor is not None:
        out = family.convert_hf_tensor(name, tensor, config)
        if out is not None:
            return [entry if len(entry) == 3 else (*entry, None) for entry in out]
    native = family.hf_to_native(name) if family.hf_to_native is not None else name
    return [] if native is None else [(native, tensor, None)]


def _hf_names(family: Any, native: str, tensor: torch.Tensor, config: ModelConfig) -> list[str]:
    if family.convert_native_tensor is not None:
        return [hf for hf, _ in family.convert_native_tensor(native, tensor, config)]
    return [family.native_to_hf(native) if family.native_to_hf is not None else native]


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")


def load_weights(model: CausalLM, family: Any, files: list[Path]) -> None:
    """Stream HF tensors from safetensors ``files`` into ``model``."""
    load_hf_tensors(model, family, iter_safetensors(files))


def load_hf_tensors(model: CausalLM, family: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into ``model`` one at a time (also for in-memory state dicts).

    Raises ValueError naming shape mismatches, missing and unexpected weights.
    """
    config = model.config
    targets = dict(model.named_parameters())
    targets.update(model.state_dict(keep_vars=True))
    written = {name: 0 for name in targets}
    seen, unexpected = set(), []
    with torch.no_grad():
        for name, tensor in named_tensors:
            seen.add(name)
            for native, part, index in _native_targets(family, name, tensor, config):
                if native == "lm_head.weight" and model.lm_head is None:
                    continue  # tied embeddings: a saved lm_head is a copy of the embedding
                if native not in targets:
                    unexpected.append(name)
                    continue
                destination = targets[native].data if index is None else targets[native].data[index]
                if tuple(destination.shape) != tuple(part.shape):
                    raise ValueError(
                        f"shape mismatch for checkpoint tensor {name!r} -> {native!r}: checkpoint has "
                        f"{tuple(part.shape)}, the model expects {tuple(destination.shape)} "
                        "(does config.json match the weights?)"
                    )
                destination.copy_(part)
                written[native] += part.numel()
    _drop_absent_mtp(model, written)
    targets = {k: v for k, v in targets.items() if not k.startswith("mtp.") or model.config.num_mtp_layers}
    missing = []
    for native, tensor in targets.items():
        if written.get(native, 0) < tensor.numel():
            names = [hf for hf in _hf_names(family, native, tensor, config) if hf not in seen]
            missing.extend(names or [native])
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"missing weights ({len(missing)}): {_listing(missing)}")
        if unexpected:
            problems.append(f"unexpected weights ({len(unexpected)}): {_listing(unexpected)}")
        raise ValueError(
            f"checkpoint does not match model_type {config.model_type!r}: " + "; ".join(problems)
        )


def _drop_absent_mtp(model: CausalLM, written: dict[str, int]) -> None:
    """transformers never saves MTP layers: without any MTP weight, build none."""
    if model.config.num_mtp_layers and not any(written[k] for k in written if k.startswith("mtp.")):
        model.mtp = torch.nn.ModuleList()
        model.config.num_mtp_layers = 0


def _stays_fp32(module: torch.nn.Module, attribute: str) -> bool:
    """Tensors a model of any dtype keeps in float32: the router's weight when the
    family routes in fp32, the expert-choice bias, and the weight of any module marked
    ``keep_fp32_weight`` (DSA's indexer head weights)."""
    if attribute == "weight" and getattr(module, "keep_fp32_weight", False):
        return True
    return isinstance(module, Router) and (
        (attribute == "weight" and module.keep_fp32) or attribute == "expert_bias"
    )


def _cast(model: CausalLM, dtype: torch.dtype) -> None:
    model.to(dtype)
    for module in model.modules():
        if _stays_fp32(module, "weight"):
            module.weight.data = module.weight.data.float()
        if _stays_fp32(module, "expert_bias") and module.expert_bias is not None:
            module.expert_bias = module.expert_bias.float()


def cast_like_loaded(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's parameters and floating buffers as :func:`load_pretrained` would hold
    them in ``dtype`` (float32 where :func:`_stays_fp32`), by name. The casts are
    differentiable: a forward on them (``torch.func.functional_call``) sends gradients
    to the original (e.g. float32 master) parameters."""
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for attribute, tensor in tensors:
            if tensor is None:
                continue
            name = f"{prefix}.{attribute}" if prefix else attribute
            if not tensor.dtype.is_floating_point:
                out[name] = tensor
            else:
                out[name] = tensor.float() if _stays_fp32(module, attribute) else tensor.to(dtype)
    return out


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The module class of a native config (Gemma-3n's decoder is its own)."""
    return Gemma3nCausalLM if config.gemma3n is not None else CausalLM


def load_pretrained(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    routing_hooks: RoutingHooks | None = None,
    family: FamilyLookup | None = None,
) -> CausalLM:
    """Load an HF checkpoint directory as a :class:`CausalLM` in eval mode.

    ``family`` maps a ``model_type`` to its :class:`~miles_host.records.ModelFamily`
    (default: the plugin registries).
    """
    hf = read_hf_config(path)
    record = (family or default_family_lookup)(hf["model_type"])
    config = native_config(hf, record)
    generation_file = Path(path) / "generation_config.json"
    if generation_file.is_file():
        config.generation_config = json.loads(generation_file.read_text())
    files = safetensors_files(path)
    with torch.device("meta"):
        model = model_class(config)(config, routing_hooks or NO_ROUTING_HOOKS)
    model.to_empty(device=device)
    _cast(model, dtype)
    load_weights(model, record, files)
    return model.eval()


def save_pretrained(
    model: CausalLM,
    path: str | Path,
    family: FamilyLookup | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write ``config.json`` (+ ``generation_config.json``) and safetensors shards in HF names.

    ``state_dict``: the weights to write under native names (default: the model's own;
    a sharded trainer passes its gathered full weights)."""
    from safetensors.torch import save_file

    path = Path(path)
    config = model.config
    embed = state_dict["embed_tokens.weight"] if state_dict is not None else model.embed_tokens.weight
    record = write_hf_config(config, path, embed.dtype, family)

    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for native, tensor in (state_dict if state_dict is not None else model.state_dict()).items():
        for hf_name, part in _converted(record, native, tensor, config):
            size = part.numel() * part.element_size()
            if shards[-1] and shard_bytes + size > max_shard_bytes:
                shards.append({})
                shard_bytes = 0
            shards[-1][hf_name] = part.detach().to("cpu").contiguous().clone()
            shard_bytes += size
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in shard})
    total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_hf_config(config: ModelConfig, path: str | Path, dtype: torch.dtype, family: FamilyLookup | None = None):
    """``config.json`` (``dtype``: the weights' dtype) and ``generation_config.json`` of a
    native config into ``path`` (created); returns the family record (for
    :func:`native_to_hf_tensors`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    record = (family or default_family_lookup)(config.model_type)
    if record.hf_config_from_native is not None:
        hf = record.hf_config_from_native(config, config.hf_config)
    else:
        hf = dict(config.hf_config)
    hf["dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    if config.generation_config:
        (path / "generation_config.json").write_text(json.dumps(config.generation_config, indent=2) + "\n")
    return record


def native_to_hf_tensors(record: Any, native: str, tensor: torch.Tensor, config: ModelConfig):
    """The ``(HF name, tensor)`` pairs one native-named tensor is saved as (the family's map)."""
    return _converted(record, native, tensor, config)


def _converted(record: Any, native: str, tensor: torch.Tensor, config: ModelConfig):
    if record.convert_native_tensor is not None:
        return record.convert_native_tensor(native, tensor, config)
    hf_name = record.native_to_hf(native) if record.native_to_hf is not None else native
    return [(hf_name, tensor)]
