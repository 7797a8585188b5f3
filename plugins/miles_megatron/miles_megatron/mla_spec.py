"""The local layer spec's core attention for Megatron-Core's MLA.

Megatron-Core 0.16's ``MLASelfAttention`` builds its core attention with
``k_channels`` / ``v_channels`` (query/key and value head dims differ), which only
TransformerEngine's attention accepts: the local ``DotProductAttention`` fails on those
arguments. :class:`LatentDotProductAttention` is the local one taking them: scores
``q . k`` over whatever key dim the tensors have, values of ``v_channels`` per head,
written into its ``kv_channels * heads`` output (``kv_channels`` is ``v_head_dim`` for
MLA models, :func:`miles_megatron.mla.mla_config_kwargs`).

Under TP it also completes one gradient. Every head's key ends in the same rotary key
``k_pos_emb`` (one per token, broadcast over the heads), and with the local
column-parallel down projection each TP rank backpropagates only its own heads' share
of it: Megatron's gather of ``linear_kv_down_proj``'s output then hands each rank its
rows of that partial gradient (its sequence-parallel path has the same gap). The
gradient of the keys' rotary columns is summed over the TP group here
(:class:`_SumRotaryKeyGrad`): summed over the rank's heads by the broadcast's backward,
it is then the sum over all heads, on every rank; the other columns stay per head.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


class LatentDotProductAttention(DotProductAttention):
    """``DotProductAttention`` accepting MLA's ``k_channels`` / ``v_channels``."""

    def __init__(self, config: Any, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                 **kwargs: Any):
        if v_channels is not None and v_channels != config.kv_channels:
            raise ValueError(f"MLA's core attention writes v_channels={v_channels} per head into kv_channels="
                             f"{config.kv_channels}: build the config with kv_channels = v_head_dim")
        super().__init__(config, *args, **kwargs)
        self.rotary_dim = getattr(config, "qk_pos_emb_head_dim", 0)

    def forward(self, query, key, value, *args, **kwargs):
        """``DotProductAttention.forward``; under TP the keys' rotary gradient summed over the ranks."""
        if self.rotary_dim and self.tp_group.size() > 1 and torch.is_grad_enabled():
            key = _SumRotaryKeyGrad.apply(key, self.rotary_dim, self.tp_group)
        return super().forward(query, key, value, *args, **kwargs)


class _SumRotaryKeyGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient of the last ``rotary_dim`` columns over ``group``."""

    @staticmethod
    def forward(ctx, key_SBND: torch.Tensor, rotary_dim: int, group: Any) -> torch.Tensor:
        ctx.rotary_dim, ctx.group = rotary_dim, group
        return key_SBND

    @staticmethod
    def backward(ctx, grad_SBND: torch.Tensor):
        grad_SBND = grad_SBND.clone()
        rotary = grad_SBND[..., -ctx.rotary_dim:].contiguous()
        torch.distributed.all_reduce(rotary, group=ctx.group)
        grad_SBND[..., -ctx.rotary_dim:] = rotary
        return grad_SBND, None, None


def rewrite_spec(spec: Any, changed: Callable[[Any], bool]) -> Any:
    """A copy of a decoder block spec, every dataclass node of it (``ModuleSpec``, submodules)
    given to ``changed``, which may change it in place (True: its fields are not visited)."""

    def rewrite(node: Any) -> Any:
        if dataclasses.is_dataclass(node) and not isinstance(node, type) and changed(node):
            return node
        if isinstance(node, (list, tuple)):
            return type(node)(rewrite(item) for item in node)
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            for field in dataclasses.fields(node):
                setattr(node, field.name, rewrite(getattr(node, field.name)))
        return node

    return rewrite(copy.deepcopy(spec))


def replace_core_attention(spec: Any, old: type, new: type, submodules: type | None = None) -> Any:
    """A copy of a decoder block spec with ``new`` as the core attention wherever it is
    ``old`` (only in ``submodules`` nodes when given)."""

    def changed(node: Any) -> bool:
        if getattr(node, "core_attention", None) is old and (submodules is None or isinstance(node, submodules)):
            node.core_attention = new
            return True
        return False

    return rewrite_spec(spec, changed)


def with_latent_core_attention(spec: Any) -> Any:
    """A copy of a decoder block spec whose MLA layers use :class:`LatentDotProductAttention`."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules

    return replace_core_attention(spec, DotProductAttention, LatentDotProductAttention, MLASelfAttentionSubmodules)
