"""Fused MoE router for decode-sized batches: top-k ids, gate weights and the expert-sorted layout in one launch.

The MoE block's eager router (:class:`~miles_host.models.mlp.Router`,
:meth:`~miles_host.models.mlp.Router.default_choice` and the weight arithmetic of
:meth:`~miles_host.models.mlp.MoE.forward`) is a chain of small kernels (softmax or
sigmoid, bias add, group top-2 / top-k / masking, top-k, gather, sum, divide, scale,
cast) followed by :func:`~miles_host.kernels.moe_grouped.plan`. At batch 1 each
costs a few microseconds even inside a CUDA graph while the expert GEMMs take ~20 us.
:func:`fused_route` takes the router logits ``[T, E]`` (the gate linear stays a GEMM)
and in ONE Triton launch writes:

- ``ids_TK`` (int64): the K chosen experts of each token in ascending id order;
- the :class:`~miles_host.kernels.moe_grouped.Routing` of those ids, exactly
  :func:`~miles_host.kernels.moe_grouped.route`'s (same padded rows, block experts
  and slot order), with ``weights_TK`` the gate weights in that slot order.

Semantics (the reference is the eager router; :func:`router_reference` is it in
float64): scores ``softmax(logits)`` or ``sigmoid(logits)`` in float32; choice
``scores + e_score_correction_bias`` (the bias steers the choice only); with
``n_group > 1`` only the ``topk_group`` groups of the largest top-2 choice sums stay
candidates; the top ``K`` choices; weights = scores at those ids, divided by their sum
plus ``norm_eps`` when ``norm_topk_prob``, times ``routed_scaling_factor``, rounded once
to the weights' dtype. Ties (equal choice values, equal group sums) go to the lower
index here; ``torch.topk`` leaves their order unspecified.

Shapes depend on T only and nothing syncs with the host, so decode graphs capture
it. :func:`supports` says which batches take it (up to :data:`MAX_TOKENS` tokens);
larger ones keep the eager router and ``plan``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_host.kernels.invariant_matmul import uses_triton
from miles_host.kernels.moe_configs import max_row_blocks
from miles_host.kernels.moe_grouped import Routing

__all__ = ["MAX_TILE", "MAX_TOKENS", "RouterSpec", "fused_route", "router_reference", "supports"]

#: most tokens one fused routing launch takes (decode batches; more: the eager router and ``plan``)
MAX_TOKENS = 64
#: most logits one launch holds in registers (tokens x experts, each rounded up to a power of two)
MAX_TILE = 16384


@dataclass(frozen=True)
class RouterSpec:
    """What the router computes (the routing fields of ``MoEConfig``)."""

    num_experts: int
    top_k: int
    score_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    norm_eps: float = 0.0
    routed_scaling_factor: float = 1.0

    @classmethod
    def of(cls, moe) -> "RouterSpec":
        """The spec of a ``MoEConfig`` (or anything with its routing fields)."""
        return cls(moe.num_experts, moe.top_k, moe.score_func, moe.n_group, moe.topk_group, moe.norm_topk_prob,
                   moe.norm_eps, moe.routed_scaling_factor)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def supports(spec: RouterSpec, num_tokens: int) -> bool:
    """Whether :func:`fused_route` takes this router and batch: 1 to :data:`MAX_TOKENS` tokens, the
    logits tile within :data:`MAX_TILE`, groups of at least two experts, at most 65535 experts."""
    group = spec.num_experts // spec.n_group
    tile = max(2, _pow2(num_tokens)) * _pow2(spec.n_group) * max(2, _pow2(group))
    return (
        0 < num_tokens <= MAX_TOKENS
        and tile <= MAX_TILE
        and spec.num_experts < 65536
        and (spec.n_group == 1 or group >= 2)
        and spec.score_func in ("softmax", "sigmoid")
    )


def fused_route(
    logits_TE: torch.Tensor, spec: RouterSpec, bias_E: torch.Tensor | None, block_m: int, weights_dtype: torch.dtype,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, Routing]:
    """``(ids_TK, routing)`` of the router logits in one launch (see the module docstring).

    ``logits_TE``: any float dtype (read in float32); ``bias_E``: the choice bias or None;
    ``block_m``: the layout's row block (the grouped GEMMs' tiles); ``weights_dtype``: of
    ``routing.weights_TK``; ``num_warps``: the program's warps (tests and timings; default
    by the tile size). Needs Triton (CUDA, or the interpreter) and :func:`supports`.
    """
    num_tokens, num_experts = logits_TE.shape
    if num_experts != spec.num_experts:
        raise ValueError(f"router logits have {num_experts} experts; the router spec has {spec.num_experts}")
    if not uses_triton(logits_TE) or not supports(spec, num_tokens):
        raise ValueError(f"fused_route runs where Triton runs, for routers and batches that supports() accepts; "
                         f"got T={num_tokens} on {logits_TE.device} with {spec} (use the eager router and plan)")
    from miles_host.kernels import _moe_router_triton

    device = logits_TE.device
    num_blocks = max_row_blocks(num_tokens * spec.top_k, num_experts, block_m)
    ids_TK = torch.empty(num_tokens, spec.top_k, dtype=torch.long, device=device)
    weights_TK = torch.empty(num_tokens, spec.top_k, dtype=weights_dtype, device=device)
    row_token_R = torch.empty(num_blocks * block_m, dtype=torch.long, device=device)
    pair_row_TK = torch.empty(num_tokens, spec.top_k, dtype=torch.long, device=device)
    block_expert_B = torch.empty(num_blocks, dtype=torch.int32, device=device)
    if logits_TE.stride(1) != 1:
        logits_TE = logits_TE.contiguous()
    if bias_E is not None:
        bias_E = bias_E.float().contiguous()
    _moe_router_triton.route_logits(logits_TE, bias_E, spec, block_m, ids_TK, weights_TK, row_token_R, pair_row_TK,
                                    block_expert_B, num_warps)
    return ids_TK, Routing(row_token_R, block_expert_B, pair_row_TK, weights_TK, block_m)


def router_reference(
    logits_TE: torch.Tensor, spec: RouterSpec, bias_E: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids_TK, weights_TK)`` of the eager router in plain PyTorch, float64; ids ascending per token,
    ties to the lower index (stable sorts instead of ``topk``). The oracle of the kernel's tests."""
    logits = logits_TE.double()
    scores = torch.softmax(logits, dim=-1) if spec.score_func == "softmax" else torch.sigmoid(logits)
    choice = scores if bias_E is None else scores + bias_E.double()
    if spec.n_group > 1:
        grouped = choice.view(-1, spec.n_group, spec.num_experts // spec.n_group)
        top2 = torch.sort(grouped, dim=-1, descending=True, stable=True).values[..., :2].sum(dim=-1)
        kept = torch.sort(top2, dim=-1, descending=True, stable=True).indices[:, : spec.topk_group]
        mask = torch.zeros_like(top2, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~mask.repeat_interleave(spec.num_experts // spec.n_group, dim=1), float("-inf"))
    chosen = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, : spec.top_k]
    ids = torch.sort(chosen, dim=-1).values
    weights = scores.gather(1, ids)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + spec.norm_eps)
    return ids, weights * spec.routed_scaling_factor
