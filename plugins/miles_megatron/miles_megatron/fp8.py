"""``--plugins fp8`` with ``--train-backend megatron``, without TransformerEngine.

Megatron-Core's local-spec ``ColumnParallelLinear`` / ``RowParallelLinear`` compute
through their ``_forward_impl``. For every such linear whose native counterpart
miles-fp8 quantizes on the rollout side (:func:`miles_fp8.recipe.is_fp8_weight` of the
native name and shape), :func:`apply_fp8` replaces that impl by miles-fp8's
block-scaled FP8 GEMMs (:func:`miles_fp8.linear.fp8_linear`) on the same master
weight: forward and backward GEMMs in FP8 E4M3 (1x128 activation groups, 128x128
weight blocks), as the native trainer's ``Fp8Linear`` computes them.

Unified with the rollout: the engine multiplies the native-layout weights quantized
by the same code at weight sync. Megatron's layouts differ from the native ones only
by the order of whole rows of heads (``linear_qkv`` interleaves q/k/v per query
group), so the 128-row blocks, hence the scales and the FP8 values, are the same when
the head dim is a multiple of 128; otherwise :func:`apply_fp8` refuses. The output
layer (LM head), embeddings and router stay in the model dtype, as in the native recipe.

Tensor parallelism above 1 is refused (Megatron's impl also owns the TP gradient
all-reduce); expert parallelism is fine (each rank holds whole experts).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

import torch

from miles_megatron.weights import GLOBAL_RENAMES, _invert, _layer_map

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.\d+\.(linear_fc[12])\.weight$")


def native_weight_name(megatron_name: str, config: Any) -> str | None:
    """The native parameter a Megatron weight comes from (experts: the stacked tensor), or None."""
    if megatron_name in _invert(GLOBAL_RENAMES):
        return _invert(GLOBAL_RENAMES)[megatron_name]
    match = _LAYER.match(megatron_name)
    if match is None:
        return None
    index, suffix = match.groups()
    expert = _EXPERT.match(suffix)
    if suffix == "self_attention.linear_qkv.weight":
        return f"layers.{index}.attn.qkv_proj.weight"
    if expert is not None:
        return f"layers.{index}.mlp.experts.{'gate_up_proj' if expert.group(1) == 'linear_fc1' else 'down_proj'}"
    native = _invert(_layer_map(config)).get(suffix)
    return f"layers.{index}.{native}" if native is not None else None


def _fp8_forward_impl(input, weight, bias=None, *, power_of_two: bool, allreduce_dgrad=False,
                      sequence_parallel=False, **_megatron_settings):
    """Megatron's ``linear_with_grad_accumulation_and_async_allreduce`` at TP = 1, in FP8."""
    from miles_fp8.linear import fp8_linear

    if allreduce_dgrad or sequence_parallel:
        raise RuntimeError("the FP8 megatron linear runs at tensor-parallel size 1 only")
    return fp8_linear(input, weight, bias, power_of_two)


def apply_fp8(gpt: torch.nn.Module, native_config: Any, config: Any) -> set[str]:
    """Route the eligible linears of ``gpt`` through FP8 GEMMs; returns their Megatron weight names."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from miles_fp8.recipe import Fp8Recipe, is_fp8_weight

    if config.tensor_model_parallel_size > 1:
        raise ValueError("--plugins fp8 with --train-backend megatron needs --tensor-model-parallel-size 1")
    power_of_two = Fp8Recipe.from_config(config).power_of_two_scales
    impl = functools.partial(_fp8_forward_impl, power_of_two=power_of_two)
    chosen: set[str] = set()
    for path, module in gpt.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or module.weight is None:
            continue  # (a tied output layer has no weight of its own)
        name = f"{path}.weight"
        native = native_weight_name(name, native_config)
        shape = tuple(module.weight.shape)
        if native is None or not is_fp8_weight(native, (1, *shape) if native.endswith("_proj") else shape):
            continue
        if native.endswith("qkv_proj.weight") and native_config.head_dim % 128:
            raise ValueError(
                f"--plugins fp8 with --train-backend megatron: head_dim {native_config.head_dim} is not a multiple "
                "of 128, so Megatron's interleaved q/k/v rows would form other 128-row FP8 blocks than the "
                "rollout's [q; k; v] layout (use --train-backend native)"
            )
        module._forward_impl = impl
        chosen.add(name)
    logger.info("fp8 (megatron train): %d linears in block-scaled FP8", len(chosen))
    return chosen
