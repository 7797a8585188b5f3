"""``miles memory``: BF16 vs INT4 weight memory of a model, from its config alone.

Parameter counts are the real ones: the HF config goes through its model-family
adapter and the native :class:`~miles_host.models.CausalLM` is built on the meta
device (no weights, no memory), then every tensor of its state dict is counted
(tied embeddings once; MTP layers when the config has them). A quantized tensor
costs 0.5 byte per parameter plus one bf16 scale (2 bytes) per group; all other
tensors stay bf16 (2 bytes per parameter).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from miles_host.models import CausalLM
from miles_host.models.loading import native_config
from miles_int4.quant import GROUP_SIZES
from miles_int4.targets import TARGETS, is_target

BF16_BYTES = 2
SCALE_BYTES = 2


@dataclass(frozen=True)
class WeightMemory:
    """Weight memory of one model under one INT4 target."""

    target: str
    group_size: int
    total_params: int
    quantized_params: int

    @property
    def kept_params(self) -> int:
        """Parameters left in bf16."""
        return self.total_params - self.quantized_params

    @property
    def bf16_bytes(self) -> int:
        """All weights in bf16."""
        return self.total_params * BF16_BYTES

    @property
    def int4_bytes(self) -> int:
        """Quantized weights as nibbles + bf16 group scales, the rest bf16."""
        packed = self.quantized_params // 2 + (self.quantized_params // self.group_size) * SCALE_BYTES
        return packed + self.kept_params * BF16_BYTES

    @property
    def ratio(self) -> float:
        """BF16 bytes / INT4 bytes of the whole model."""
        return self.bf16_bytes / self.int4_bytes

    @property
    def quantized_ratio(self) -> float:
        """BF16 / INT4 bytes of the quantized weights alone (4 / (1 + 4/group_size) ~ 3.9x at 128)."""
        if not self.quantized_params:
            return 1.0
        packed = self.quantized_params // 2 + (self.quantized_params // self.group_size) * SCALE_BYTES
        return self.quantized_params * BF16_BYTES / packed


def param_shapes(hf_config: dict[str, Any], family: Callable[[str], Any] | None = None) -> dict[str, tuple[int, ...]]:
    """Native parameter name -> shape of the model an HF config describes (built on meta)."""
    from miles_host.models.loading import default_family_lookup

    if "model_type" not in hf_config:
        raise ValueError("the config has no 'model_type'; cannot tell which model family to use")
    record = (family or default_family_lookup)(hf_config["model_type"])
    config = native_config(dict(hf_config), record)
    with torch.device("meta"):
        model = CausalLM(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def weight_memory(
    hf_config: dict[str, Any], group_size: int = 128, target: str = "all", family: Callable[[str], Any] | None = None
) -> WeightMemory:
    """BF16 vs INT4 weight memory of the model ``hf_config`` describes."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"--int4-group-size must be one of {GROUP_SIZES}, got {group_size}")
    shapes = param_shapes(hf_config, family)
    total = quantized = 0
    for name, shape in shapes.items():
        count = 1
        for dim in shape:
            count *= dim
        total += count
        if is_target(name, len(shape), target):
            if shape[-1] % group_size:
                raise ValueError(f"int4: {name} has shape {shape}; group size {group_size} does not divide {shape[-1]}")
            quantized += count
    return WeightMemory(target, group_size, total, quantized)


def read_config(path: str | Path) -> dict[str, Any]:
    """An HF ``config.json`` from a file or a checkpoint directory."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: give a checkpoint directory or a config.json file")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from exc


def _gb(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:,.1f} GB"


def memory_table(hf_config: dict[str, Any], group_size: int = 128, family=None) -> str:
    """A small table: BF16, INT4 experts-only and INT4 all-linears weight memory."""
    rows = [weight_memory(hf_config, group_size, target, family) for target in TARGETS]
    name = hf_config.get("_name_or_path") or hf_config.get("model_type")
    lines = [
        f"{name}: {rows[0].total_params / 1e9:,.2f}B parameters, INT4 group size {group_size}",
        f"  {'weights':<22} {'params INT4':>14} {'memory':>12} {'vs BF16':>8} {'INT4 part':>10}",
        f"  {'BF16':<22} {'-':>14} {_gb(rows[0].bf16_bytes):>12} {'1.00x':>8} {'-':>10}",
    ]
    for row in rows:
        lines.append(
            f"  {'INT4 ' + row.target:<22} {row.quantized_params / 1e9:>13,.2f}B {_gb(row.int4_bytes):>12} "
            f"{row.ratio:>7.2f}x {row.quantized_ratio:>9.2f}x"
        )
    return "\n".join(lines)


def add_memory_arguments(parser) -> None:
    """``miles memory --hf-checkpoint PATH | --config PATH [--int4-group-size N]``."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf-checkpoint", help="HF checkpoint directory (only config.json is read)")
    source.add_argument("--config", help="an HF config.json file (or a directory holding one)")
    parser.add_argument("--int4-group-size", type=int, default=128, choices=list(GROUP_SIZES))


def run_memory(args) -> int:
    """Print the memory table."""
    print(memory_table(read_config(args.hf_checkpoint or args.config), args.int4_group_size))
    return 0
