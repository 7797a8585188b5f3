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

Tensor parallelism: each rank's shard is quantized on its own, which gives the full
weight's FP8 blocks when every shard boundary falls on a 128 boundary (the local shape
a multiple of 128 both ways; :func:`apply_fp8` refuses otherwise). The FP8 impl does the
communication Megatron's impl does around its GEMMs: with sequence parallelism the
sequence-sharded input is all-gathered (its gradient reduce-scattered), without it the
input gradient of a column-parallel linear is all-reduced over the TP group. Expert
parallelism: each rank holds whole experts.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

import torch

from miles_megatron.runtime import EXPERT_TP
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
                      sequence_parallel=False, tp_group=None, **_megatron_settings):
    """Megatron's ``linear_with_grad_accumulation_and_async_allreduce`` in FP8: the same
    input all-gather (sequence parallel) or input-gradient all-reduce (``allreduce_dgrad``)
    over ``tp_group`` around the FP8 GEMMs."""
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        gather_from_sequence_parallel_region)
    from miles_fp8.linear import fp8_linear

    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
    elif allreduce_dgrad:
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    return fp8_linear(input, weight, bias, power_of_two)


def _full_shape(module: torch.nn.Module, tp: int) -> tuple[int, ...]:
    """The unsharded weight shape of a (column- or row-) parallel linear at TP size ``tp``."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    rows, cols = module.weight.shape
    return (rows * tp, cols) if isinstance(module, ColumnParallelLinear) else (rows, cols * tp)


def apply_fp8(gpt: torch.nn.Module, native_config: Any, config: Any) -> set[str]:
    """Route the eligible linears of ``gpt`` through FP8 GEMMs; returns their Megatron weight names."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from miles_fp8.recipe import Fp8Recipe, is_fp8_weight

    power_of_two = Fp8Recipe.from_config(config).power_of_two_scales
    impl = functools.partial(_fp8_forward_impl, power_of_two=power_of_two)
    chosen: set[str] = set()
    for path, module in gpt.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or module.weight is None:
            continue  # (a tied output layer has no weight of its own)
        name = f"{path}.weight"
        native = native_weight_name(name, native_config)
        local = tuple(module.weight.shape)
        tp = EXPERT_TP if getattr(module, "is_expert", False) else int(config.tensor_model_parallel_size)
        shape = _full_shape(module, tp) if tp > 1 else local
        if native is None or not is_fp8_weight(native, (1, *shape) if native.endswith("_proj") else shape):
            continue
        if local[0] % 128 or local[1] % 128:
            raise ValueError(
                f"--plugins fp8 with --train-backend megatron: {name} is split over {tp} tensor-parallel ranks into "
                f"{list(local)} shards, which cut its 128 x 128 FP8 blocks (the rollout quantizes the whole "
                f"{list(shape)} weight); use a --tensor-model-parallel-size that leaves multiples of 128, or 1")
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
