"""Context parallelism (CP) of the megatron backend (``--context-parallel-size N``).

Megatron-Core's ``parallel_state`` gets the CP size: each rank of a CP group holds a
part of every sequence of the micro-batch, and Megatron's DDP reduces the dense
gradients over the data-parallel-with-context group (``dp_cp``), so each parameter's
gradient sums every CP rank's tokens.

The split is Megatron's load-balanced one (``get_batch_on_this_cp_rank``): the padded
``[S, B]`` batch of packed sequences (:class:`~miles_megatron.layout.PaddedLayout`, ``S`` a
multiple of ``2 * N``) is cut along ``S`` into ``2 * N`` chunks and CP rank ``r`` keeps
chunks ``r`` and ``2N - 1 - r`` (under causal attention the early chunks are cheap, the
late ones dear: each rank gets one of each). Every rank of the group sees the same
micro-batches; the pipeline stages of one CP rank pass its rows on.

Attention. Megatron-Core 0.16 runs CP attention only in TransformerEngine's
``TEDotProductAttention``; its local ``DotProductAttention`` refuses CP.
:class:`ContextParallelAttention` is the local attention with CP, the all-gather
variant (TransformerEngine's ``cp_comm_type="all_gather"``): the keys and values of the
group are all-gathered (backward: their gradients summed over the group and each rank's
rows kept), and the rank's queries attend to them under :meth:`ContextShard.causal_mask`,
built from the global positions of the query rows and of the gathered key rows. Padding
rows sit after the real tokens of their sequence, so causality keeps them out.

Output. On the last stage each CP rank computes the log-probs (and entropy) of its own
rows with the output layer, and the group's are all-gathered in sequence order
(:meth:`ContextShard.gather_sequence`; ``MegatronPolicy.packed_log_probs``), so each CP rank
computes the host's loss over whole sequences from them; the loss each rank backpropagates
is divided by ``N`` (the gather's backward sums the group's gradients of each row), see
:mod:`miles_megatron.schedule`. Callers of the hidden states themselves
(``forward_hidden``) get the group's gathered rows.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.dot_product_attention import DotProductAttention

#: Megatron's name of the CP attention variant this module implements
CP_COMM_TYPE = "all_gather"


def cp_group_and_rank() -> tuple[Any, int, int]:
    """``(group, rank, size)`` of this rank's CP group (Megatron's ``parallel_state``)."""
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group(), ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()


def chunk_rows(seq_len: int, size: int, rank: int) -> torch.Tensor:
    """The sequence positions (indices along ``S``) CP rank ``rank`` of ``size`` holds:
    chunks ``rank`` and ``2 * size - 1 - rank`` of ``2 * size``."""
    if seq_len % (2 * size):
        raise ValueError(f"context parallelism over {size} ranks splits the padded sequence length into {2 * size} "
                         f"chunks; {seq_len} is not a multiple of {2 * size}")
    chunk = seq_len // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def _flat_collectives(group: Any) -> bool:
    """NCCL: one flat all-gather / reduce-scatter; gloo has neither (lists and an all-reduce)."""
    return dist.get_backend(group) == "nccl"


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over ``group`` (rank-major); backward: the gradient summed
    over the group (each rank's copy of the gathered rows fed its own computation),
    this rank's rows kept (a reduce-scatter; on gloo an all-reduce, then the slice)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: Any, rank: int, size: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.rows = group, rank, local.shape[0]
        local = local.contiguous()
        if _flat_collectives(group):
            out = local.new_empty((size * local.shape[0], *local.shape[1:]))
            dist.all_gather_into_tensor(out, local, group=group)
            return out
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local, group=group)
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        if _flat_collectives(ctx.group):
            out = grad.new_empty((ctx.rows, *grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None, None, None
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows], None, None, None


def gather_rows(local: torch.Tensor) -> torch.Tensor:
    """``local`` ``[s, ...]`` of every rank of this rank's CP group, rank-major ``[N * s, ...]``."""
    group, rank, size = cp_group_and_rank()
    return _GatherSequence.apply(local, group, rank, size)


@dataclass
class ContextShard:
    """This CP rank's rows of a padded ``[S, B]`` batch (see module doc)."""

    seq_len: int
    #: ``[S / N]``: the positions along ``S`` of this rank's rows, in its order
    local_S: torch.Tensor
    #: ``[S]``: the position along ``S`` of each row of the group's gathered rows (rank-major)
    gathered_S: torch.Tensor

    @classmethod
    def current(cls, seq_len: int, device: torch.device) -> "ContextShard":
        _, rank, size = cp_group_and_rank()
        gathered = torch.cat([chunk_rows(seq_len, size, r) for r in range(size)])
        return cls(seq_len, chunk_rows(seq_len, size, rank).to(device), gathered.to(device))

    def take(self, values_SB: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``[S, ...]`` values."""
        return values_SB[self.local_S]

    def causal_mask(self) -> torch.Tensor:
        """``[1, 1, S / N, S]`` boolean, True where attention is masked: a query row sees the
        gathered key rows at or before its position."""
        return (self.gathered_S[None, :] > self.local_S[:, None])[None, None]

    def gather_sequence(self, local_SBH: torch.Tensor) -> torch.Tensor:
        """Every rank's rows ``[S / N, B, H]`` -> ``[S, B, H]`` in sequence order."""
        gathered = gather_rows(local_SBH)
        return gathered[torch.argsort(self.gathered_S)]


class ContextParallelAttention(DotProductAttention):
    """The local ``DotProductAttention`` under CP (see module doc): keys and values of the
    CP group gathered, the mask given by the caller (:meth:`ContextShard.causal_mask`)."""

    def __init__(self, config: Any, *args: Any, cp_comm_type: str | None = None, **kwargs: Any):
        if cp_comm_type not in (None, CP_COMM_TYPE):
            raise ValueError(f"the local context-parallel attention is the {CP_COMM_TYPE!r} variant, not "
                             f"{cp_comm_type!r}")
        local = copy.copy(config)
        local.context_parallel_size = 1  # (the parent refuses CP; this class adds it)
        super().__init__(local, *args, **kwargs)
        self.config = config

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        return super().forward(query, gather_rows(key), gather_rows(value), attention_mask, *args, **kwargs)


def with_context_parallel_attention(spec: Any) -> Any:
    """A copy of a decoder block spec whose attention is :class:`ContextParallelAttention`."""
    from miles_megatron.mla_spec import replace_core_attention

    return replace_core_attention(spec, DotProductAttention, ContextParallelAttention)


def check_context_parallel(native_config: Any, cp: int) -> None:
    """What CP runs with here: dense GQA models (MoE and MLA models refused, named)."""
    if cp == 1:
        return
    problems = []
    if native_config.moe is not None:
        problems.append("MoE layers (the expert grid over TP x CP x DP is not built)")
    if getattr(native_config, "mla", None) is not None:
        problems.append("multi-latent attention (its latent core attention has no CP variant here)")
    if problems:
        raise ValueError(f"--context-parallel-size {cp} with {' and '.join(problems)} is not supported by "
                         "--train-backend megatron; use --context-parallel-size 1")
