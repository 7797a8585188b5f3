"""The ``fp8`` precision recipe: which weights go FP8, and the three Precision callables.

Which weights are FP8 is a pure function of a native parameter's name and shape
(:func:`is_fp8_weight`), so the trainer, the rollout engine, weight sync and the
offline converter agree without sharing state:

- 2-D ``<module>.weight`` of a linear whose leaf name is not a high-precision
  layer (lm_head, embeddings, MoE router, shared-expert gate, the MTP head: they
  stay in the model dtype, as DeepSeek-V3 and SGLang keep them) and whose dims are
  both multiples of 128;
- the 3-D routed-expert stacks ``<...>.experts.gate_up_proj`` / ``.down_proj`` with
  128-divisible dims (quantized per expert).

Linears with other dims stay in the model dtype; the swap logs them once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from miles_host.models.mlp import Experts
from miles_fp8.device import check_fp8_device
from miles_fp8.experts import Fp8Experts, Fp8InferenceExperts
from miles_fp8.linear import Fp8InferenceLinear, Fp8Linear
from miles_fp8.quant import BLOCK, quantize_weight

logger = logging.getLogger(__name__)

#: leaf module names kept in high precision (native and HF spellings)
HIGH_PRECISION_LEAVES = frozenset({"lm_head", "head", "embed_tokens", "router", "gate", "shared_gate", "shared_expert_gate"})
EXPERT_STACKS = ("experts.gate_up_proj", "experts.down_proj")
SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class Fp8Recipe:
    """The run's FP8 settings, from the plugin's flags."""

    power_of_two_scales: bool = False

    @classmethod
    def from_config(cls, config: Any) -> "Fp8Recipe":
        """Read ``--fp8-format``, ``--fp8-recipe``, ``--fp8-power-of-two-scales`` (defaults when absent)."""
        fmt = getattr(config, "fp8_format", "e4m3") or "e4m3"
        if fmt != "e4m3":
            raise ValueError(
                f"--fp8-format {fmt} is not supported by miles-fp8: block scaling uses E4M3 for every GEMM "
                "(forward and backward, as DeepSeek-V3 does); drop the flag or pass --fp8-format e4m3"
            )
        recipe = getattr(config, "fp8_recipe", "blockwise") or "blockwise"
        if recipe != "blockwise":
            raise ValueError(f"--fp8-recipe {recipe} is not supported; miles-fp8 implements 'blockwise' (1x128 / 128x128)")
        return cls(power_of_two_scales=bool(getattr(config, "fp8_power_of_two_scales", False)))


def _leaf(module_path: str) -> str:
    return module_path.rsplit(".", 1)[-1]


def is_fp8_weight(name: str, shape: Iterable[int]) -> bool:
    """Whether the native parameter ``name`` of ``shape`` is stored and multiplied in FP8."""
    shape = tuple(shape)
    if len(shape) == 3 and name.endswith(EXPERT_STACKS):
        return shape[1] % BLOCK == 0 and shape[2] % BLOCK == 0
    if len(shape) != 2 or not name.endswith(".weight"):
        return False
    if _leaf(name[: -len(".weight")]) in HIGH_PRECISION_LEAVES:
        return False
    return shape[0] % BLOCK == 0 and shape[1] % BLOCK == 0


def _swap_modules(model: torch.nn.Module, make_linear, make_experts) -> tuple[set[str], list[str]]:
    """Replace eligible children in place; return (FP8 parameter names, kept-in-bf16 notes)."""
    fp8_names: set[str] = set()
    kept: list[str] = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            path = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is torch.nn.Linear:
                if _leaf(path) in HIGH_PRECISION_LEAVES:
                    continue
                if is_fp8_weight(f"{path}.weight", child.weight.shape):
                    setattr(parent, child_name, make_linear(child, path))
                    fp8_names.add(f"{path}.weight")
                else:
                    kept.append(f"{path} {tuple(child.weight.shape)}")
            elif type(child) is Experts:
                names = [f"{path}.gate_up_proj", f"{path}.down_proj"]
                if all(is_fp8_weight(n, getattr(child, n.rsplit(".", 1)[1]).shape) for n in names):
                    setattr(parent, child_name, make_experts(child, path))
                    fp8_names.update(names)
                else:
                    kept.append(f"{path} {tuple(child.gate_up_proj.shape)}/{tuple(child.down_proj.shape)}")
    return fp8_names, kept


def _check_consistent(model: torch.nn.Module, fp8_names: set[str], side: str) -> None:
    """Every name the sync will quantize must belong to a swapped module (else sync would break)."""
    expected = {name for name, tensor in model.state_dict().items()
                if not name.endswith(SCALE_SUFFIX) and tensor.dtype.is_floating_point
                and tensor.dtype != torch.float8_e4m3fn and is_fp8_weight(name, tensor.shape)}
    stray = sorted(expected - fp8_names)
    if stray:
        raise ValueError(
            f"fp8 ({side}): parameters {stray[:5]} look like FP8 linear weights but their modules are not "
            "nn.Linear / Experts, so miles-fp8 cannot swap them; add their leaf name to "
            "miles_fp8.recipe.HIGH_PRECISION_LEAVES or use --precision bf16"
        )


def _log(side: str, fp8_names: set[str], kept: list[str]) -> None:
    logger.info("fp8 (%s): %d weights in block-scaled FP8", side, len(fp8_names))
    if kept:
        logger.info(
            "fp8 (%s): %d linears stay in the model dtype (dims not multiples of %d): %s",
            side, len(kept), BLOCK, ", ".join(kept[:8]) + (" ..." if len(kept) > 8 else ""),
        )


def _model_device(model: torch.nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def _prepare(model: torch.nn.Module, config: Any, side: str, linear_class, experts_class) -> torch.nn.Module:
    """Swap eligible linears / experts of ``model`` for ``linear_class`` / ``experts_class``."""
    recipe = Fp8Recipe.from_config(config)
    check_fp8_device(_model_device(model))
    p2 = recipe.power_of_two_scales
    fp8_names, kept = _swap_modules(
        model,
        lambda linear, path: linear_class.from_linear(linear, p2, path),
        lambda experts, path: experts_class.from_experts(experts, p2, path),
    )
    _check_consistent(model, fp8_names, side)
    _log(side, fp8_names, kept)
    return model


def prepare_train_model(model: torch.nn.Module, config: Any) -> torch.nn.Module:
    """Swap eligible linears / experts of the training model for FP8-GEMM ones (master weights kept)."""
    return _prepare(model, config, "train", Fp8Linear, Fp8Experts)


def prepare_rollout_model(model: torch.nn.Module, config: Any) -> torch.nn.Module:
    """Swap eligible linears / experts of the rollout model for FP8-weight inference ones."""
    return _prepare(model, config, "rollout", Fp8InferenceLinear, Fp8InferenceExperts)


@torch.no_grad()
def convert_for_rollout(named_tensors: Iterable[tuple[str, torch.Tensor]], config: Any) -> list[tuple[str, torch.Tensor]]:
    """``(name, weight)`` -> ``(name, fp8 weight), (name + "_scale_inv", float32 scales)`` for FP8 weights.

    Quantizes the trainer's master weights with the same code the training forward
    uses, so the rollout multiplies exactly the weights training multiplied.
    """
    p2 = Fp8Recipe.from_config(config).power_of_two_scales
    converted: list[tuple[str, torch.Tensor]] = []
    for name, tensor in named_tensors:
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float8_e4m3fn and is_fp8_weight(name, tensor.shape):
            q, scale = quantize_weight(tensor.detach(), p2)
            converted.append((name, q))
            converted.append((name + SCALE_SUFFIX, scale))
        else:
            converted.append((name, tensor))
    return converted
