"""Megatron-Core's linears at tensor-parallel size 1 on ``F.linear``.

Without TransformerEngine, Megatron's ``ColumnParallelLinear`` and ``RowParallelLinear``
compute through ``linear_with_grad_accumulation_and_async_allreduce``: a Python autograd
Function whose forward serves tensor parallelism (input all-gather under sequence
parallelism, the input gradient's all-reduce) and gradient-accumulation fusion, and whose
backward runs its two GEMMs from Python. At TP size 1 without those it computes
``F.linear`` (the same GEMMs; under autocast the same casts), and the Python backward is
host time per linear per backward pass that the native trainer does not spend: the megatron
trainer's dense training is host-bound in its own layers (GPU busy 55% of the profiled step
against the native trainer's 64%).

:func:`use_plain_linears` gives the covered linears of a layer ``F.linear`` as their
``_forward_impl`` (autograd's own backward; the weight gradient reaches Megatron's DDP
through its usual hook). Not covered, keeping Megatron's: TP above 1, sequence parallelism,
gradient-accumulation fusion, deferred embedding gradients, delayed weight gradients, the
routed experts' linears (the grouped experts read those), and a linear whose
``_forward_impl`` was already replaced (``--plugins fp8``: :mod:`miles_megatron.fp8`,
which also replaces these when it applies later).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def plain_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 **_megatron_settings: Any) -> torch.Tensor:
    """``linear_with_grad_accumulation_and_async_allreduce`` at TP size 1 without fusion (module doc)."""
    return F.linear(input, weight, bias)


def covers(module: Any) -> bool:
    """Whether :func:`plain_linear` computes what the Megatron linear ``module`` computes (module doc)."""
    settings = module.config  # (Megatron's TransformerConfig)
    return (
        module.tp_group.size() == 1
        and not module.sequence_parallel
        and not module.gradient_accumulation_fusion
        and not getattr(module, "is_expert", False)
        and not settings.defer_embedding_wgrad_compute
        and not getattr(settings, "delay_wgrad_compute", False)
        and "_forward_impl" not in vars(module)
    )


def use_plain_linears(layer: torch.nn.Module) -> int:
    """Give the covered Megatron linears of ``layer`` :func:`plain_linear`; how many."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    count = 0
    for module in layer.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and covers(module):
            module._forward_impl = plain_linear
            count += 1
    return count
