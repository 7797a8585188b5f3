"""Triton paged attention for prefill and decode (GPU; needs triton).

One kernel serves both: a program takes a tile of query tokens of one sequence
and one KV head, with all query heads of that KV head's group stacked as rows
(so GQA reads each K/V block once per group), and streams the sequence's
context through its block table with an online softmax. Decode is the case of
one query token per sequence. :func:`miles_host.rollout.attention.paged_attention_reference`
is the oracle it is tested against (tests/rollout/test_gpu_attention.py).

Tensor legend: T = tokens, H = heads, D = head dim, N = blocks, S = slots per block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_host.rollout.attention import AttentionMetadata

PREFILL_ROWS = 64   # query rows (tokens x heads of a group) per program in prefill
DECODE_ROWS = 16    # tl.dot needs at least 16 rows
KEYS_PER_ITERATION = 64


@triton.jit
def _paged_attention_kernel(
    Q, K_cache, V_cache, Out,
    block_tables, context_lens, cu_seqlens_q, tile_seq, tile_q_start,
    scale, softcap, window,
    stride_qt, stride_qh,
    stride_kn, stride_ks, stride_kh,
    stride_vn, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq + tile)
    q_first = tl.load(tile_q_start + tile)
    q_end = tl.load(cu_seqlens_q + seq + 1)
    context = tl.load(context_lens + seq)

    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    token = q_first + rows // GROUP_PAD
    g = rows % GROUP_PAD
    row_valid = (token < q_end) & (g < GROUP)
    head = kv_head * GROUP + g
    position = context - (q_end - token)

    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    q = tl.load(
        Q + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_valid[:, None] & (d[None, :] < D), other=0.0,
    )

    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, DV_PAD], tl.float32)

    last_token = tl.minimum(q_first + BLOCK_M, q_end) - 1
    hi = context - (q_end - last_token) + 1          # keys past the tile's last query are masked
    lo = 0
    if USE_WINDOW:
        first_position = context - (q_end - q_first)
        lo = tl.maximum(first_position - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    keys = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        key_pos = start + keys
        key_valid = key_pos < hi
        block = tl.load(block_tables + seq * stride_bt + key_pos // PAGE, mask=key_valid, other=0).to(tl.int64)
        slot = key_pos % PAGE
        k = tl.load(
            K_cache + block[:, None] * stride_kn + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
            mask=key_valid[:, None] & (d[None, :] < D), other=0.0,
        )
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        if USE_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        allowed = key_valid[None, :] & (key_pos[None, :] <= position[:, None])
        if USE_WINDOW:
            allowed = allowed & ((position[:, None] - key_pos[None, :]) < window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V_cache + block[:, None] * stride_vn + slot[:, None] * stride_vs + kv_head * stride_vh + dv[None, :],
            mask=key_valid[:, None] & (dv[None, :] < DV), other=0.0,
        )
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(
        Out + token[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_valid[:, None] & (dv[None, :] < DV),
    )


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def tokens_per_tile(num_q_heads: int, num_kv_heads: int, is_decode: bool, invariant: bool = False) -> int:
    """Query tokens one program covers (rows = tokens x padded group size). ``invariant``:
    the decode tile for prefill and training too, so a token's rows see the same kernel
    whatever the step (the decode tile: decode is where rollout time goes)."""
    group_pad = _next_pow2(num_q_heads // num_kv_heads)
    rows = DECODE_ROWS if is_decode or invariant else PREFILL_ROWS
    return max(1, rows // group_pad)


def build_tiles(cu_seqlens_q: list[int], block_m: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, first token) of every query tile of a step, as int32 tensors."""
    tile_seq, tile_start = [], []
    for b in range(len(cu_seqlens_q) - 1):
        for start in range(cu_seqlens_q[b], cu_seqlens_q[b + 1], block_m):
            tile_seq.append(b)
            tile_start.append(start)
    return (
        torch.tensor(tile_seq, dtype=torch.int32, device=device),
        torch.tensor(tile_start, dtype=torch.int32, device=device),
    )


def paged_attention_triton(
    q_THD: torch.Tensor,
    k_cache_NSHD: torch.Tensor,
    v_cache_NSHD: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """Triton version of :func:`~miles_host.rollout.attention.paged_attention_reference`.

    ``meta.tile_seq``/``meta.tile_q_start`` must come from :func:`build_tiles` with
    :func:`tokens_per_tile` tokens per tile (the model runner builds them).

    ``invariant`` (``--true-on-policy``): one tile shape (``DECODE_ROWS`` rows x
    ``KEYS_PER_ITERATION`` keys, 4 warps) whatever the step or page size, so a query's
    result depends only on its own context: its key blocks start at position 0 (or
    at a multiple of the block below its window), blocks past its own position add
    exact zeros, and keys are never split across programs.
    """
    num_tokens, num_q_heads, head_dim = q_THD.shape
    _, page, num_kv_heads, _ = k_cache_NSHD.shape
    head_dim_v = v_cache_NSHD.shape[-1]
    group = num_q_heads // num_kv_heads
    block_m = tokens_per_tile(num_q_heads, num_kv_heads, meta.is_decode, invariant)
    out = torch.empty(num_tokens, num_q_heads, head_dim_v, dtype=q_THD.dtype, device=q_THD.device)
    q_THD = q_THD.contiguous()
    grid = (meta.tile_seq.shape[0], num_kv_heads)
    # a whole number of pages (powers of two); fixed in invariant mode (any page size works)
    block_n = KEYS_PER_ITERATION if invariant else max(KEYS_PER_ITERATION, page)
    _paged_attention_kernel[grid](
        q_THD, k_cache_NSHD, v_cache_NSHD, out,
        meta.block_tables_BM, meta.context_lens_B, meta.cu_seqlens_q, meta.tile_seq, meta.tile_q_start,
        float(scale), float(logit_softcap or 1.0), int(sliding_window or 0),
        q_THD.stride(0), q_THD.stride(1),
        k_cache_NSHD.stride(0), k_cache_NSHD.stride(1), k_cache_NSHD.stride(2),
        v_cache_NSHD.stride(0), v_cache_NSHD.stride(1), v_cache_NSHD.stride(2),
        out.stride(0), out.stride(1),
        meta.block_tables_BM.stride(0),
        GROUP=group, GROUP_PAD=_next_pow2(group), BLOCK_M=block_m,
        PAGE=page, BLOCK_N=block_n,
        D=head_dim, D_PAD=max(16, _next_pow2(head_dim)), DV=head_dim_v, DV_PAD=max(16, _next_pow2(head_dim_v)),
        USE_SOFTCAP=logit_softcap is not None, USE_WINDOW=sliding_window is not None,
        IEEE=q_THD.dtype == torch.float32,
        num_warps=4, num_stages=2,
    )
    return out

