"""Offline conversion of an HF checkpoint to compressed-tensors ``pack-quantized`` INT4.

The format SGLang and vLLM load for weight-only INT4 (W4A16): each quantized
linear ``X.weight [N, K]`` becomes ``X.weight_packed`` (int32 ``[N, K/8]``),
``X.weight_scale`` (bf16 ``[N, K/group_size]``) and ``X.weight_shape`` (int64
``[2]``); everything else is copied as it is. ``config.json`` gains

    "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "kv_cache_scheme": null,
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
            "output_activations": null, "weights": {"num_bits": 4, "type": "int", "symmetric": true,
            "strategy": "group", "group_size": N, "dynamic": false, "actorder": null,
            "block_structure": null, "observer": "minmax", "observer_kwargs": {}}}},
        "ignore": [<every linear module left in bf16, by name, e.g. "lm_head">]}

Which weights are quantized is decided on their native names by
:func:`miles_int4.targets.is_target` (through the model-family adapter), so the
checkpoint holds exactly the INT4 weights the ``int4`` rollout runs with.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from miles_host.models import CausalLM
from miles_host.models.loading import iter_safetensors, native_config, read_hf_config, safetensors_files
from miles_host.models.mlp import Router
from miles_int4.quant import compress
from miles_int4.settings import Int4Settings

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def quantization_config(group_size: int, ignore: list[str]) -> dict[str, Any]:
    """The compressed-tensors ``quantization_config`` of an INT4 W4A16 group-quantized checkpoint."""
    weights = {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size,
        "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax", "observer_kwargs": {},
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None}
        },
        "ignore": ignore,
    }


def _native_names(family: Any, name: str, tensor: torch.Tensor, config: Any) -> list[str]:
    if family.convert_hf_tensor is not None:
        out = family.convert_hf_tensor(name, tensor, config)
        if out is not None:
            return [entry[0] for entry in out]
    native = family.hf_to_native(name) if family.hf_to_native is not None else name
    return [] if native is None else [native]


class _ShardWriter:
    """Writes tensors to safetensors shards of at most ``max_bytes`` each, then the index."""

    def __init__(self, dst: Path, max_bytes: int):
        self.dst, self.max_bytes = dst, max_bytes
        self.shard: dict[str, torch.Tensor] = {}
        self.shard_bytes = 0
        self.files: list[list[str]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.shard and self.shard_bytes + size > self.max_bytes:
            self._flush()
        self.shard[name] = tensor.contiguous()
        self.shard_bytes += size
        self.total += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self.shard, str(self.dst / f"part-{len(self.files):05d}.safetensors"), metadata={"format": "pt"})
        self.files.append(list(self.shard))
        self.shard, self.shard_bytes = {}, 0

    def close(self) -> None:
        if self.shard or not self.files:
            self._flush()
        count = len(self.files)
        if count == 1:
            (self.dst / "part-00000.safetensors").rename(self.dst / "model.safetensors")
            return
        weight_map = {}
        for number, names in enumerate(self.files):
            final = f"model-{number + 1:05d}-of-{count:05d}.safetensors"
            (self.dst / f"part-{number:05d}.safetensors").rename(self.dst / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    group_size: int = 128,
    target: str = "experts",
    *,
    family: Callable[[str], Any] | None = None,
    max_shard_bytes: int = 5 * 1024**3,
) -> dict[str, Any]:
    """Write ``src`` (HF checkpoint directory) to ``dst`` as compressed-tensors INT4.

    ``target``: ``experts`` (routed MoE experts) or ``all`` (every linear but the
    heads and routers). Returns a summary: ``quantized`` (tensor count),
    ``kept`` (tensor count), ``ignore`` (the linears left in bf16), ``bytes``.
    Raises ValueError naming the layer when ``group_size`` does not divide its input dim.
    """
    from miles_host.models.loading import default_family_lookup
    from miles_int4.targets import is_target

    settings = Int4Settings(group_size=group_size, target=target)
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError(f"convert: destination {dst} is the source; choose a new directory")
    hf = read_hf_config(src)
    if "quantization_config" in hf:
        raise ValueError(f"{src} is already quantized ({hf['quantization_config'].get('quant_method')}); convert a bf16 checkpoint")
    record = (family or default_family_lookup)(hf["model_type"])
    config = native_config(hf, record)
    files = safetensors_files(src)
    with torch.device("meta"):
        model = CausalLM(config)
    ranks = {name: tensor.dim() for name, tensor in model.state_dict().items()}
    owners = dict(model.named_modules())
    dst.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(dst, max_shard_bytes)
    summary: dict[str, Any] = {"quantized": 0, "kept": 0, "ignore": []}
    for name, tensor in iter_safetensors(files):
        natives = [n for n in _native_names(record, name, tensor, config) if n in ranks]
        if any(is_target(n, ranks[n], settings.target) for n in natives):
            for out_name, out in compress(name, tensor, settings.group_size):
                writer.add(out_name, out)
            summary["quantized"] += 1
            continue
        writer.add(name, tensor)
        summary["kept"] += 1
        linear = any(isinstance(owners.get(n.rpartition(".")[0]), (torch.nn.Linear, Router)) for n in natives)
        if linear and name.endswith(".weight"):
            summary["ignore"].append(name.removesuffix(".weight"))
    if "lm_head" not in summary["ignore"]:
        summary["ignore"].append("lm_head")  # tied heads have no tensor of their own but are linears in engines
    writer.close()
    summary["bytes"] = writer.total
    hf["quantization_config"] = quantization_config(settings.group_size, summary["ignore"])
    (dst / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    for path in src.iterdir():
        if path.is_file() and path.name not in (*_WEIGHT_FILES, "config.json") and not path.name.endswith(".safetensors"):
            shutil.copy2(path, dst / path.name)
    return summary


def add_convert_arguments(parser) -> None:
    """``miles convert --to int4 SRC DST [--group-size N] [--target experts|all]`` (SRC, DST: the host's)."""
    parser.add_argument("--group-size", "--int4-group-size", dest="group_size", type=int, default=128, choices=[32, 64, 128])
    parser.add_argument("--target", "--int4-target", dest="target", default="experts", choices=["experts", "all"])


def run_convert(args) -> int:
    """Run the conversion and print what was written."""
    summary = convert_checkpoint(args.src, args.dst, args.group_size, args.target)
    print(
        f"wrote {args.dst}: {summary['quantized']} INT4 weights (group size {args.group_size}), "
        f"{summary['kept']} kept as they were, {summary['bytes'] / 1e9:.3f} GB; "
        f"{len(summary['ignore'])} linears in 'ignore'"
    )
    return 0
