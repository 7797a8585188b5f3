"""Triton body of :mod:`miles_host.kernels.moe_router` (imported only where Triton runs).

:func:`_router_kernel` is one program for the whole batch. It reads the router
logits as a ``[T_P, G_P, S_P]`` tile (token, expert group, expert in the group;
one group when routing is not group-limited), scores them (softmax or sigmoid, in
float32), adds the optional choice bias, keeps the ``topk_group`` best groups (by
the sum of their two best choice values), picks the ``TOP_K`` best experts, and
writes their ids in ascending order with their gate weights (the scores at those
ids, optionally renormalised, times the routed scaling factor, rounded once to the
weights' dtype). After a barrier it reads the ids back and builds the padded,
expert-sorted row layout with :func:`~miles_host.kernels._moe_grouped_triton.fill_layout`,
the code of the routing kernel of the fused MoE; one token's layout (batch-1 decode) is
written from the ids in registers (:func:`_one_token_layout`: the same tensors).

Every "best of" is one integer max: each candidate's float32 value is mapped to
an int32 of the same order and packed with ``65535 - expert`` into an int64, so
the max is the largest value and, among equal values, the lowest expert id; the
value comes back from the key bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_host.kernels import pdl
from miles_host.kernels._moe_grouped_triton import fill_layout, layout_constants
from miles_host.kernels._triton_common import pdl_start, pdl_wait
from miles_host.kernels._split_k_triton import cast_rne, emulate_rounding

#: key of a candidate that is out of the race (padding, already chosen): below every float's key
_OUT = tl.constexpr(-(2**62))


@triton.jit
def _key(value, expert):
    """int64 key: orders like ``value`` (float32), ties broken toward the lower ``expert``."""
    bits = (value + 0.0).to(tl.int32, bitcast=True)  # + 0.0: -0.0 becomes +0.0 (equal values, equal keys)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return ordered.to(tl.int64) * 65536 + (65535 - expert).to(tl.int64)


@triton.jit
def _expert_of(key):
    return (65535 - (key & 65535)).to(tl.int32)


@triton.jit
def _value_of(key):
    ordered = (key >> 16).to(tl.int32)
    return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _router_kernel(
    Logits, Bias, Ids, Weights,
    RowToken, PairRow, BlockExpert, Scratch,
    num_tokens, stride_lt, num_rows, num_blocks, norm_eps, scaling,
    TOP_K: tl.constexpr, K_P: tl.constexpr, T_P: tl.constexpr,
    G: tl.constexpr, G_P: tl.constexpr, S: tl.constexpr, S_P: tl.constexpr, TOPK_GROUP: tl.constexpr,
    SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, EMULATE: tl.constexpr,
    E: tl.constexpr, NB: tl.constexpr, NP: tl.constexpr, BLOCK_M: tl.constexpr,
    MAX_ROWS: tl.constexpr, MAX_BLOCKS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNK: tl.constexpr,
    ONE_TOKEN: tl.constexpr = False, PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    pdl_wait(PDL)
    tok = tl.arange(0, T_P)
    t3 = tok[:, None, None]
    g3 = tl.arange(0, G_P)[None, :, None]
    s3 = tl.arange(0, S_P)[None, None, :]
    expert = g3 * S + s3  # [1, G_P, S_P]
    real = (g3 < G) & (s3 < S)
    row_ok = t3 < num_tokens
    logits = tl.load(Logits + t3.to(tl.int64) * stride_lt + expert, mask=real & row_ok, other=0.0).to(tl.float32)

    # scores (float32, as the eager router) and the choice values
    if SOFTMAX:
        logits = tl.where(real, logits, float("-inf"))
        top = tl.max(tl.max(logits, axis=2), axis=1)
        num = tl.exp(logits - top[:, None, None])
        scores = tl.math.div_rn(num, tl.sum(tl.sum(num, axis=2), axis=1)[:, None, None])
    else:
        scores = tl.where(real, tl.math.div_rn(tl.full(logits.shape, 1.0, tl.float32), 1.0 + tl.exp(-logits)), 0.0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(Bias + expert, mask=real, other=0.0).to(tl.float32)
    keys = tl.where(real, _key(choice, expert), _OUT)

    # group-limited: keep the TOPK_GROUP groups of the largest top-2 sums
    if G > 1:
        first = tl.max(keys, axis=2)  # [T_P, G_P]
        second = tl.max(tl.where(expert == _expert_of(first)[:, :, None], _OUT, keys), axis=2)
        group_keys = _key(_value_of(first) + _value_of(second), tl.arange(0, G_P)[None, :])
        group_keys = tl.where(tl.arange(0, G_P)[None, :] < G, group_keys, _OUT)
        kept = tl.zeros((T_P, G_P), dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            best = _expert_of(tl.max(group_keys, axis=1))  # a group index here
            hit = tl.arange(0, G_P)[None, :] == best[:, None]
            kept = tl.where(hit, 1, kept)
            group_keys = tl.where(hit, _OUT, group_keys)
        dropped = tl.where(kept[:, :, None] > 0, choice, float("-inf"))  # the eager masked_fill
        keys = tl.where(real, _key(dropped, expert), _OUT)

    # top-k: ids in the order chosen, their scores
    slot = tl.arange(0, K_P)[None, :]
    chosen = tl.full((T_P, K_P), E, dtype=tl.int32)  # E: an empty slot (sorts last)
    picked = tl.zeros((T_P, K_P), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.max(tl.max(keys, axis=2), axis=1)
        best_expert = _expert_of(best)
        hit = expert == best_expert[:, None, None]
        if HAS_BIAS:
            score = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=2), axis=1)
        else:
            score = _value_of(best)
        chosen = tl.where(slot == k, best_expert[:, None], chosen)
        picked = tl.where(slot == k, score[:, None], picked)
        keys = tl.where(hit, _OUT, keys)

    # gate weights: renormalised over the K chosen, scaled, rounded once
    if NORM:
        picked = tl.math.div_rn(picked, tl.sum(picked, axis=1)[:, None] + norm_eps)
    picked = picked * scaling

    # ascending expert order: slot j of a token takes its j-th smallest id
    other = tl.arange(0, K_P)[None, None, :]
    mine = tl.arange(0, K_P)[None, :, None]
    ids_j = chosen[:, None, :]
    ids_k = chosen[:, :, None]
    rank = tl.sum(((ids_j < ids_k) | ((ids_j == ids_k) & (other < mine))).to(tl.int32), axis=2)  # [T_P, K_P]
    placed = rank[:, None, :] == mine  # [t, j, k]: slot k goes to position j
    ids_sorted = tl.sum(tl.where(placed, chosen[:, None, :], 0), axis=2)
    weights_sorted = tl.sum(tl.where(placed, picked[:, None, :], 0.0), axis=2)
    out = tok[:, None] * TOP_K + slot
    out_ok = (tok[:, None] < num_tokens) & (slot < TOP_K)
    tl.store(Ids + out, ids_sorted.to(tl.int64), mask=out_ok)
    tl.store(Weights + out, cast_rne(weights_sorted, Weights.dtype.element_ty, EMULATE), mask=out_ok)

    # the expert-sorted row layout of those ids
    if ONE_TOKEN:
        _one_token_layout(tl.sum(tl.where(tok[:, None] == 0, ids_sorted, 0), axis=0), RowToken, PairRow, BlockExpert,
                          num_rows, num_blocks, TOP_K, K_P, BLOCK_M, MAX_ROWS, MAX_BLOCKS, CHUNK, BLOCK_CHUNK)
    else:
        tl.debug_barrier()
        pairs = tl.arange(0, NP)
        ids = tl.load(Ids + pairs, mask=pairs < num_tokens * TOP_K, other=E).to(tl.int32)
        fill_layout(ids, RowToken, PairRow, BlockExpert, Scratch, num_rows, num_blocks,
                    TOP_K, E, NB, NP, BLOCK_M, MAX_ROWS, MAX_BLOCKS, CHUNK, BLOCK_CHUNK)


@triton.jit
def _one_token_layout(ids, RowToken, PairRow, BlockExpert, num_rows, num_blocks,
                      TOP_K: tl.constexpr, K_P: tl.constexpr, BLOCK_M: tl.constexpr, MAX_ROWS: tl.constexpr,
                      MAX_BLOCKS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNK: tl.constexpr):
    """:func:`fill_layout` of one token's ``ids`` (``[K_P]``, distinct, ascending, in registers): slot
    ``k``'s expert has the ``k``-th row block to itself, the token in its first row; no histogram,
    sort or read-back."""
    slot = tl.arange(0, K_P)
    tl.store(PairRow + slot, (slot * BLOCK_M).to(tl.int64), mask=slot < TOP_K)
    for start in range(0, MAX_BLOCKS, BLOCK_CHUNK):
        blocks = start + tl.arange(0, BLOCK_CHUNK)
        expert = tl.sum(tl.where(blocks[:, None] == slot[None, :], ids[None, :], 0), axis=1)
        tl.store(BlockExpert + blocks, tl.where(blocks < TOP_K, expert, -1), mask=blocks < num_blocks)
    for start in range(0, MAX_ROWS, CHUNK):
        rows = start + tl.arange(0, CHUNK)
        first = (rows % BLOCK_M == 0) & (rows // BLOCK_M < TOP_K)
        tl.store(RowToken + rows, tl.where(first, 0, -1).to(tl.int64), mask=rows < num_rows)


def default_warps(tile: int, num_pairs: int) -> int:
    """Warps of the one program: one for a batch-1/2 tile (every reduction stays inside a warp), four
    up to 4096 logits, eight above."""
    if tile <= 512 and num_pairs <= 64:
        return 1
    return 4 if tile <= 4096 and num_pairs < 1024 else 8


def route_logits(logits_TE, bias_E, spec, block_m, ids_TK, weights_TK, row_token_R, pair_row_TK, block_expert_B,
                 num_warps=None):
    """Fill the ids, weights and layout tensors from ``logits_TE`` in one launch (see :mod:`moe_router`);
    ``num_warps``: the program's warps (None: :func:`default_warps`)."""
    num_tokens, num_experts = logits_TE.shape
    group = num_experts // spec.n_group
    t_p = max(2, triton.next_power_of_2(num_tokens))
    g_p, s_p = triton.next_power_of_2(spec.n_group), max(2, triton.next_power_of_2(group))
    constants = layout_constants(num_tokens * spec.top_k, num_experts, block_m)
    scratch = torch.empty(constants["NB"], dtype=torch.int32, device=logits_TE.device)
    _router_kernel[(1,)](
        logits_TE, bias_E if bias_E is not None else logits_TE, ids_TK, weights_TK,
        row_token_R, pair_row_TK, block_expert_B, scratch,
        num_tokens, logits_TE.stride(0), row_token_R.shape[0], block_expert_B.shape[0],
        float(spec.norm_eps), float(spec.routed_scaling_factor),
        TOP_K=spec.top_k, K_P=max(2, triton.next_power_of_2(spec.top_k)), T_P=t_p,
        G=spec.n_group, G_P=g_p, S=group, S_P=s_p, TOPK_GROUP=spec.topk_group,
        SOFTMAX=spec.score_func == "softmax", HAS_BIAS=bias_E is not None, NORM=spec.norm_topk_prob,
        EMULATE=emulate_rounding(), ONE_TOKEN=num_tokens == 1, **constants,
        num_warps=num_warps or default_warps(t_p * g_p * s_p, num_tokens * spec.top_k), **pdl.options(logits_TE),
    )
