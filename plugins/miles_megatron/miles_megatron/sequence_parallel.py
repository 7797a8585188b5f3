"""``--sequence-parallel`` (with TP > 1) on Megatron-Core's local layer spec.

Megatron's sequence parallelism splits the activations between the tensor-parallel
regions along the sequence: the embedding scatters them, column-parallel linears
all-gather their input, row-parallel linears reduce-scatter their output; the norms
and residual adds in between run on this rank's ``S / TP`` positions. Megatron's own
torch norm (``WrappedTorchNorm``, the local spec's) refuses the mode because nothing
reduces its weight's gradient, which is then partial (this rank's positions only).
:class:`SequenceParallelRMSNorm` is the same ``torch.nn.RMSNorm``, its weight marked
``sequence_parallel``, and Megatron's ``finalize_model_grads`` all-reduces the marked
gradients over the TP group (as it does for TransformerEngine's norms;
:mod:`miles_megatron.schedule`). The policy pads the sequence to a multiple of TP and
gathers the final hidden states back (``MegatronPolicy.forward_hidden``), so the
log-probs, losses and gradients are those of TP without sequence parallelism.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch


class SequenceParallelRMSNorm:
    """``WrappedTorchNorm``'s signature; a ``torch.nn.RMSNorm`` whose weight is marked
    ``sequence_parallel`` (its gradient is all-reduced over the TP group)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_unused: Any) -> torch.nn.Module:
        if config.normalization != "RMSNorm":
            raise ValueError(f"sequence parallelism here takes RMSNorm models, not {config.normalization}")
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        norm.weight.sequence_parallel = True
        return norm


def norms_for_sequence_parallel(spec: Any) -> Any:
    """A copy of a decoder block spec with every ``WrappedTorchNorm`` replaced by
    :class:`SequenceParallelRMSNorm` (the per-head q/k norms too: they run inside the
    attention on every position of this rank's heads, and their gradients were already
    reduced over TP; a marked weight is reduced once either way)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def rewrite(node: Any) -> Any:
        if node is WrappedTorchNorm:
            return SequenceParallelRMSNorm
        if isinstance(node, (list, tuple)):
            return type(node)(rewrite(item) for item in node)
        if isinstance(node, dict):
            return {key: rewrite(value) for key, value in node.items()}
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            for field in dataclasses.fields(node):
                setattr(node, field.name, rewrite(getattr(node, field.name)))
        return node  # ModuleSpec and the submodule dataclasses are dataclasses: rewritten above

    return rewrite(copy.deepcopy(spec))
