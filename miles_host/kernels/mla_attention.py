"""Triton attention of absorbed DeepSeek MLA queries over a latent paged cache (GPU; needs triton).

The engine keeps one cache row per token and MLA layer: the normalized KV latent
(``kv_lora_rank`` values) followed by the rotated rope key shared by all heads
(``qk_rope_head_dim``), as SGLang stores it: 576 values per token and layer for
DeepSeek-V3 against 128 heads x (192 + 128) when keys and values are expanded per head.
The caller absorbs each head's key up-projection into its query (``q_nope @ W_UK``), so
attention is multi-query over the latents: head ``n`` scores a key as
``q_latent[n] . c + q_rope[n] . k_rope`` and sums the latents ``c`` themselves as values;
the caller maps the result back through each head's value up-projection (``@ W_UV``).

A program takes the query tokens of one tile (:func:`~miles_host.kernels.paged_attention.build_tiles`,
tiled for one KV head of all query heads, as the model runner tiles a step whose cache has
latent layers) times a block of ``BLOCK_H`` heads, so a tile's rows never exceed
:data:`LATENT_ROWS` (a 128-head layer runs 8 head blocks per token); a decode step with few
programs also splits its keys (split-KV, merged in the same launch by the last split to
arrive, as :func:`~miles_host.kernels.paged_attention.paged_attention_triton`).
:func:`miles_host.rollout.attention.paged_attention_reference` over the same cache (one KV
head, keys = the whole row, values = its latent part) is the oracle.

Tensor legend: T tokens, N heads, R latent rank, P rope dims, X blocks, S slots per block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_host.kernels import pdl, split_k
from miles_host.kernels._triton_common import pdl_start, pdl_wait
from miles_host.kernels.attention_metadata import AttentionMetadata
from miles_host.kernels.paged_attention import (
    _active_splits, _merge_splits, _next_pow2, _online_softmax_step, _split_range, _store_rows, build_tiles,
    decode_splits, tokens_per_tile,
)

#: query rows (tokens x heads) of one program: a 512-wide latent accumulator of 16 rows is
#: 32 KB of registers
LATENT_ROWS = 16
#: keys per iteration: 32 latent rows of 512 bf16 values are 32 KB of shared memory per stage
LATENT_KEYS = 32
#: split-KV decode programs per SM aimed at (:func:`decode_splits`): what the DeepSeek-V3 shape was
#: measured with (the GQA kernel's own choice was swept apart from it)
LATENT_PROGRAMS_PER_SM = 2


@triton.jit
def _mla_attention_kernel(
    Q_latent, Q_rope, Cache, Out, Partial_acc, Partial_ml, Counters,
    block_tables, context_lens, cu_seqlens_q, tile_seq, tile_q_start,
    scale, num_heads,
    stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_cn, stride_cs, stride_ot, stride_oh, stride_bt,
    R: tl.constexpr, R_PAD: tl.constexpr, P: tl.constexpr, P_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program ``(tile x head blocks + head block, split)``: the tile's query tokens x ``BLOCK_H``
    heads over split ``split`` of their keys (all of them when ``SPLITS`` = 1). A tile's head
    blocks are neighbours in the grid: the programs reading one sequence's latents run together
    (L2 reuse)."""
    pdl_start(PDL)
    pair = tl.program_id(0)
    head_blocks = tl.cdiv(num_heads, BLOCK_H)
    tile = pair // head_blocks
    split = tl.program_id(1)
    seq = tl.load(tile_seq + tile)  # the step's metadata: inputs of the step, read before the PDL wait
    q_first = tl.load(tile_q_start + tile)
    q_end = tl.load(cu_seqlens_q + seq + 1)
    context = tl.load(context_lens + seq)
    last_token = tl.minimum(q_first + BLOCK_M, q_end) - 1
    hi = context - (q_end - last_token) + 1          # keys past the tile's last query are masked
    active = _active_splits(0, hi, SPLITS, BLOCK_N)
    if split < active:  # a split past the keys does nothing (no wait, store, count)
        pdl_wait(PDL)
        _mla_split(Q_latent, Q_rope, Cache, Out, Partial_acc, Partial_ml, Counters, block_tables, scale, num_heads,
                   stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_cn, stride_cs, stride_ot, stride_oh,
                   stride_bt, pair, pair % head_blocks, split, seq, q_first, q_end, context, hi, active,
                   R, R_PAD, P, P_PAD, BLOCK_M, BLOCK_H, PAGE, BLOCK_N, SPLITS, IEEE)


@triton.jit
def _mla_split(
    Q_latent, Q_rope, Cache, Out, Partial_acc, Partial_ml, Counters, block_tables, scale, num_heads,
    stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_cn, stride_cs, stride_ot, stride_oh, stride_bt,
    pair, head_block, split, seq, q_first, q_end, context, hi, active,
    R: tl.constexpr, R_PAD: tl.constexpr, P: tl.constexpr, P_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr, IEEE: tl.constexpr,
):
    """One split of :func:`_mla_attention_kernel` that holds keys: its queries' online softmax over
    the split's keys, stored (one split) or merged (:func:`_merge_splits`)."""
    ROWS: tl.constexpr = BLOCK_M * BLOCK_H
    rows = tl.arange(0, ROWS)
    token = q_first + rows // BLOCK_H
    head = head_block * BLOCK_H + rows % BLOCK_H
    row_valid = (token < q_end) & (head < num_heads)
    position = context - (q_end - token)
    r = tl.arange(0, R_PAD)
    p = tl.arange(0, P_PAD)
    q_lat = tl.load(Q_latent + token[:, None] * stride_qlt + head[:, None] * stride_qlh + r[None, :],
                    mask=row_valid[:, None] & (r[None, :] < R), other=0.0)
    q_rot = tl.load(Q_rope + token[:, None] * stride_qrt + head[:, None] * stride_qrh + p[None, :],
                    mask=row_valid[:, None] & (p[None, :] < P), other=0.0)
    start, end = _split_range(0, hi, split, SPLITS, BLOCK_N)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, R_PAD], tl.float32)
    keys = tl.arange(0, BLOCK_N)
    for key_start in range(start, end, BLOCK_N):
        key_pos = key_start + keys
        key_valid = key_pos < end
        block = tl.load(block_tables + seq * stride_bt + key_pos // PAGE, mask=key_valid, other=0).to(tl.int64)
        row = Cache + block * stride_cn + (key_pos % PAGE) * stride_cs
        c = tl.load(row[:, None] + r[None, :], mask=key_valid[:, None] & (r[None, :] < R), other=0.0)
        k_rot = tl.load(row[:, None] + R + p[None, :], mask=key_valid[:, None] & (p[None, :] < P), other=0.0)
        if IEEE:
            s = tl.dot(q_lat, tl.trans(c), input_precision="ieee")
            s += tl.dot(q_rot, tl.trans(k_rot), input_precision="ieee")
        else:
            s = tl.dot(q_lat, tl.trans(c))
            s += tl.dot(q_rot, tl.trans(k_rot))
        s = s * scale
        allowed = key_valid[None, :] & (key_pos[None, :] <= position[:, None])
        prob, alpha, m_new, l_i = _online_softmax_step(tl.where(allowed, s, float("-inf")), m_i, l_i)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(prob.to(c.dtype), c, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(prob.to(c.dtype), c)
        m_i = m_new
    if SPLITS == 1:
        _store_rows(Out, acc, l_i, token, head, row_valid, stride_ot, stride_oh, R, R_PAD)
    else:
        _merge_splits(acc, m_i, l_i, Partial_acc, Partial_ml, Counters, pair, split, row_valid,
                      Out, token, head, stride_ot, stride_oh, active, ROWS, R, R_PAD, SPLITS)


def heads_per_program(num_heads: int, tokens_in_tile: int) -> int:
    """Heads of one program: the tile's tokens times these fill at most :data:`LATENT_ROWS` rows."""
    return min(_next_pow2(num_heads), max(1, LATENT_ROWS // tokens_in_tile))


def mla_attention_triton(
    q_latent_TNR: torch.Tensor,
    q_rope_TNP: torch.Tensor,
    cache_XSC: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    splits: int | None = None,
) -> torch.Tensor:
    """``[T, N, R]``: each head's softmax-weighted sum of its context's latents.

    ``cache_XSC``: the layer's cache rows ``[X, S, R + P]`` (latent, then rope key);
    ``q_latent_TNR``/``q_rope_TNP`` in the cache's dtype. The step's tiles are ``meta``'s when the
    model runner built them (one KV head of ``N`` query heads), else built here from its host
    lengths. A decode step splits its keys over ``splits`` programs (:func:`decode_splits`
    when None); 1 does not split.
    """
    num_tokens, num_heads, rank = q_latent_TNR.shape
    rope = q_rope_TNP.shape[-1]
    page = cache_XSC.shape[1]
    block_m = tokens_per_tile(num_heads, 1, meta.is_decode)
    if meta.tile_seq is None:  # (the flash-attn backend's steps: tiles for this kernel)
        meta.tile_seq, meta.tile_q_start = build_tiles(meta.cu_seqlens_q_host, block_m, q_latent_TNR.device)
    block_h = heads_per_program(num_heads, block_m)
    head_blocks = triton.cdiv(num_heads, block_h)
    num_tiles = meta.tile_seq.shape[0]
    out = torch.empty(num_tokens, num_heads, rank, dtype=q_latent_TNR.dtype, device=q_latent_TNR.device)
    if splits is None:
        splits = (decode_splits(num_tiles, head_blocks, q_latent_TNR.device, LATENT_PROGRAMS_PER_SM)
                  if meta.is_decode else 1)
    r_pad = max(16, _next_pow2(rank))
    if splits == 1:  # no workspace: placeholders the kernel never reads
        partial_acc = partial_ml = counters = out
    else:
        rows, pairs = block_m * block_h, num_tiles * head_blocks
        workspace = torch.empty(pairs * splits * rows * (r_pad + 2), dtype=torch.float32, device=out.device)
        partial_acc, partial_ml = workspace.split([pairs * splits * rows * r_pad, pairs * splits * rows * 2])
        counters = split_k.semaphores(out.device, pairs)
    if q_latent_TNR.stride(-1) != 1:
        q_latent_TNR = q_latent_TNR.contiguous()
    if q_rope_TNP.stride(-1) != 1:
        q_rope_TNP = q_rope_TNP.contiguous()
    _mla_attention_kernel[(num_tiles * head_blocks, splits)](
        q_latent_TNR, q_rope_TNP, cache_XSC, out, partial_acc, partial_ml, counters,
        meta.block_tables_BM, meta.context_lens_B, meta.cu_seqlens_q, meta.tile_seq, meta.tile_q_start,
        float(scale), num_heads,
        q_latent_TNR.stride(0), q_latent_TNR.stride(1), q_rope_TNP.stride(0), q_rope_TNP.stride(1),
        cache_XSC.stride(0), cache_XSC.stride(1), out.stride(0), out.stride(1), meta.block_tables_BM.stride(0),
        R=rank, R_PAD=r_pad, P=rope, P_PAD=max(16, _next_pow2(rope)),
        BLOCK_M=block_m, BLOCK_H=block_h, PAGE=page, BLOCK_N=LATENT_KEYS, SPLITS=splits,
        IEEE=q_latent_TNR.dtype == torch.float32, num_warps=4, num_stages=2, **pdl.options(q_latent_TNR),
    )
    return out
