"""``miles convert --to fp8 SRC DST``: an HF checkpoint -> a block-FP8 HF checkpoint.

Linear weights (the :func:`~miles_fp8.recipe.is_fp8_weight` rule applied to HF
names) become ``float8_e4m3fn`` ``weight`` + float32 ``weight_scale_inv``
(128x128 blocks, per expert for stacked experts); everything else is copied as
is. ``config.json`` gets the ``quantization_config`` that SGLang, vLLM and
DeepSeek-V3's own loader read::

    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
     "weight_block_size": [128, 128]}

plus ``ignored_layers`` naming the linears left in high precision because their
dims are not multiples of 128. Tensors stream one at a time (no model is built).
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from miles_host.models.loading import iter_safetensors, read_hf_config, safetensors_files
from miles_fp8.quant import FP8_DTYPE, dequantize, quantize_weight
from miles_fp8.recipe import HIGH_PRECISION_LEAVES, SCALE_SUFFIX, is_fp8_weight

QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


@dataclass
class ConvertSummary:
    """What :func:`convert_checkpoint` wrote."""

    quantized: list[str] = field(default_factory=list)
    ignored_layers: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    """The fp8 converter's own options (besides SRC and DST)."""
    parser.add_argument("--fp8-power-of-two-scales", action="store_true", help="round block scales up to powers of two")
    parser.add_argument("--max-shard-size-gb", type=float, default=5.0, help="largest safetensors shard (GiB)")


def _skipped_for_dims(name: str, tensor: torch.Tensor) -> bool:
    """A linear weight that stays high precision only because of its dims (-> ignored_layers)."""
    if tensor.ndim != 2 or not name.endswith(".weight") or not tensor.dtype.is_floating_point:
        return False
    module = name[: -len(".weight")]
    return module.rsplit(".", 1)[-1] not in HIGH_PRECISION_LEAVES and "norm" not in module and not is_fp8_weight(name, tensor.shape)


def _converted(name: str, tensor: torch.Tensor, power_of_two: bool, summary: ConvertSummary):
    if tensor.dtype.is_floating_point and tensor.dtype != FP8_DTYPE and is_fp8_weight(name, tensor.shape):
        q, scale = quantize_weight(tensor, power_of_two)
        summary.quantized.append(name)
        return [(name, q), (name + SCALE_SUFFIX, scale)]
    if _skipped_for_dims(name, tensor):
        summary.ignored_layers.append(name[: -len(".weight")])
    return [(name, tensor)]


def _write_shards(dst: Path, tensors: Iterator[tuple[str, torch.Tensor]], max_shard_bytes: int) -> list[str]:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(dst / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    weight_map, files = {}, []
    for number, shard in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(dst / file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in shard})
        files.append(file_name)
    total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files


def convert_checkpoint(src: str | Path, dst: str | Path, args: Any = None) -> ConvertSummary:
    """Write the block-FP8 version of the HF checkpoint ``src`` to the folder ``dst``.

    ``args`` (an argparse namespace, optional) may carry ``fp8_power_of_two_scales``
    and ``max_shard_size_gb``. Tokenizer and other files are copied unchanged.
    Raises FileNotFoundError / ValueError for a bad ``src`` or a ``dst`` that is ``src``.
    """
    src, dst = Path(src), Path(dst)
    hf_config = read_hf_config(src)
    if dst.resolve() == src.resolve():
        raise ValueError(f"convert: DST {dst} is SRC; write the FP8 checkpoint to a new folder")
    if hf_config.get("quantization_config"):
        raise ValueError(f"convert: {src} is already quantized ({hf_config['quantization_config']}); convert a bf16/fp32 checkpoint")
    files = safetensors_files(src)
    power_of_two = bool(getattr(args, "fp8_power_of_two_scales", False))
    max_shard_bytes = int(float(getattr(args, "max_shard_size_gb", 5.0) or 5.0) * 1024**3)
    dst.mkdir(parents=True, exist_ok=True)
    summary = ConvertSummary()

    def stream():
        for name, tensor in iter_safetensors(files):
            yield from _converted(name, tensor, power_of_two, summary)

    summary.files = _write_shards(dst, stream(), max_shard_bytes)
    quantization = dict(QUANTIZATION_CONFIG)
    if summary.ignored_layers:
        quantization["ignored_layers"] = sorted(set(summary.ignored_layers))
    hf_config["quantization_config"] = quantization
    (dst / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    for item in src.iterdir():
        if item.is_file() and item.name != "config.json" and item.name not in _WEIGHT_FILES and item.suffix != ".safetensors":
            shutil.copy2(item, dst / item.name)
    return summary


def iter_dequantized(path: str | Path, dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a block-FP8 checkpoint with FP8 weights dequantized to ``dtype`` (scales dropped).

    E.g. ``load_hf_tensors(model, family, iter_dequantized(path))`` loads an FP8
    checkpoint into a high-precision model.
    """
    tensors = dict(iter_safetensors(safetensors_files(path)))
    for name, tensor in tensors.items():
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in tensors:
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        yield name, (dequantize(tensor, scale, dtype) if scale is not None and tensor.dtype == FP8_DTYPE else tensor)


def run_convert(args: argparse.Namespace) -> int:
    """``miles convert --to fp8 SRC DST``: convert and print a one-line summary."""
    summary = convert_checkpoint(args.src, args.dst, args)
    ignored = f"; kept in high precision (dims): {len(summary.ignored_layers)}" if summary.ignored_layers else ""
    print(f"wrote {args.dst}: {len(summary.quantized)} weights in block FP8 (E4M3, 128x128){ignored}")
    return 0


