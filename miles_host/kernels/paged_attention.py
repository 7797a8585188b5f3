"""Triton paged attention for prefill and decode (GPU; needs triton).

One kernel serves both: a program takes a tile of query tokens of one sequence
and one KV head, with all query heads of that KV head's group stacked as rows
(so GQA reads each K/V block once per group), and streams the sequence's
context through its block table with an online softmax. Decode is the case of
one query token per sequence. :func:`miles_host.rollout.attention.paged_attention_reference`
is the oracle it is tested against (tests/rollout/test_gpu_attention.py).

A decode step with few sequences has too few (tile, KV head) programs to fill the
GPU (batch 1 of 8 KV heads: 8 programs for 132 SMs), so outside invariant mode its
keys are also split over programs ("flash-decoding", ``SPLITS`` of :func:`_paged_attention_kernel`),
whose partial softmaxes the last program of each tile merges in the same launch.
:func:`write_kv_cache` stores a step's K and V rows in the cache in one kernel.

Tensor legend: T = tokens, H = heads, D = head dim, N = blocks, S = slots per block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_host.kernels import pdl, split_k
from miles_host.kernels._triton_common import pdl_start, pdl_wait
from miles_host.kernels._split_k_triton import cast_rne, emulate_rounding
from miles_host.kernels.attention_metadata import AttentionMetadata

PREFILL_ROWS = 64   # query rows (tokens x heads of a group) per program in prefill
DECODE_ROWS = 16    # tl.dot needs at least 16 rows
KEYS_PER_ITERATION = 64
#: split-KV decode (:func:`decode_splits`): programs per SM aimed at, most splits of a tile's keys.
#: ``bench/attention_decode_sweep.py`` on an H100 (Qwen3-30B-A3B heads, 32 q / 4 kv, cold pages, us per
#: launch): batch 1 at 320 / 4096 keys, 16 splits of 64 keys 7.9 / 16.4 against 16 of 32 8.4 / 19.8 (8 splits
#: of 64: 6.2 / 19.6; 32: 8.6 / 13.6); batch 32, 4 splits of 64 keys 14.7 / 95.9 against 2 of 32 16.7 / 136.3
DECODE_PROGRAMS_PER_SM = 4
MAX_DECODE_SPLITS = 16
#: keys per iteration of the split decode kernel (see above)
DECODE_SPLIT_KEYS = 64
#: SMs assumed off CUDA (the interpreter): an H200's
DEFAULT_SMS = 132
#: elements of K (or V) one program of the KV write stores at most (heads x padded head dim)
KV_WRITE_ELEMENTS = 4096


@triton.jit
def _tile_keys(
    cu_seqlens_q, context_lens, tile_seq, tile_q_start, tile, window, chunk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_CHUNK: tl.constexpr = False,
):
    """The step's metadata of ``tile`` and the keys its queries see: ``(seq, q_first, q_end, context,
    lo, hi)``; keys ``[lo, hi)``, ``lo`` a multiple of ``BLOCK_N`` (0 without a window or chunks: else
    below the first query's window / the start of its chunk). Reads only inputs of the step (tiles,
    query offsets, context lengths: written before its first kernel, never by one), so a PDL
    program calls it before its wait for the previous kernel."""
    seq = tl.load(tile_seq + tile)
    q_first = tl.load(tile_q_start + tile)
    q_end = tl.load(cu_seqlens_q + seq + 1)
    context = tl.load(context_lens + seq)
    last_token = tl.minimum(q_first + BLOCK_M, q_end) - 1
    hi = context - (q_end - last_token) + 1          # keys past the tile's last query are masked
    lo = 0
    if USE_WINDOW:
        first_position = context - (q_end - q_first)
        lo = tl.maximum(first_position - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if USE_CHUNK:
        first_position = context - (q_end - q_first)
        lo = tl.maximum(lo, ((first_position // chunk) * chunk // BLOCK_N) * BLOCK_N)
    return seq, q_first, q_end, context, lo, hi


@triton.jit
def _tile_queries(
    Q, q_first, q_end, context, kv_head, stride_qt, stride_qh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
):
    """The query rows of a tile (:func:`_tile_keys`) for ``kv_head`` (tokens x padded group):
    ``(token, head, row_valid, position, q)``. Reads the queries: after a PDL program's wait."""
    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    token = q_first + rows // GROUP_PAD
    g = rows % GROUP_PAD
    row_valid = (token < q_end) & (g < GROUP)
    head = kv_head * GROUP + g
    position = context - (q_end - token)

    d = tl.arange(0, D_PAD)
    q = tl.load(
        Q + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_valid[:, None] & (d[None, :] < D), other=0.0,
    )
    return token, head, row_valid, position, q


@triton.jit
def _online_softmax_step(s, m_i, l_i):
    """One key block of an online softmax: masked scores ``s`` (``-inf``), the running row max
    ``m_i`` and sum ``l_i``; returns ``(p, alpha, m_new, l_new)``: the block's unnormalized
    probabilities, the factor that rescales what was accumulated, the new max and sum."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _attend_blocks(
    q, m_i, l_i, acc, K_cache, V_cache, block_tables, seq, kv_head, position, lo, hi,
    scale, softcap, window,
    stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh, stride_bt,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, IEEE: tl.constexpr,
    chunk=0, USE_CHUNK: tl.constexpr = False,
):
    """Online softmax of the rows of ``q`` over the keys ``[lo, hi)`` in blocks of ``BLOCK_N`` from ``lo``
    (any key, each through the block table); returns the updated ``(m_i, l_i, acc)``."""
    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
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
        if USE_CHUNK:
            allowed = allowed & ((key_pos[None, :] // chunk) == (position[:, None] // chunk))
        p, alpha, m_new, l_i = _online_softmax_step(tl.where(allowed, s, float("-inf")), m_i, l_i)
        v = tl.load(
            V_cache + block[:, None] * stride_vn + slot[:, None] * stride_vs + kv_head * stride_vh + dv[None, :],
            mask=key_valid[:, None] & (dv[None, :] < DV), other=0.0,
        )
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _store_rows(Out, acc, l_i, token, head, row_valid, stride_ot, stride_oh, DV: tl.constexpr, DV_PAD: tl.constexpr,
                m_i=0.0, Sinks=None, USE_SINKS: tl.constexpr = False):
    """``acc / l`` of every valid query row to ``Out`` (rows whose keys were all masked: zeros).
    ``USE_SINKS``: the head's sink logit joins the softmax's denominator (``acc`` and ``l``
    are relative to the row max ``m_i``), its probability is dropped."""
    if USE_SINKS:
        sink = tl.load(Sinks + head, mask=row_valid, other=0.0).to(tl.float32)
        l_i = l_i + tl.exp(sink - m_i)
    dv = tl.arange(0, DV_PAD)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(
        Out + token[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_valid[:, None] & (dv[None, :] < DV),
    )


@triton.jit
def _split_range(lo, hi, split, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys ``[start, end)`` of split ``split`` of the keys ``[lo, hi)``: whole ``BLOCK_N`` blocks per
    split, sized from this step's context (a window's keys are split, not the context's); short
    contexts leave the last splits empty (they store m = -inf, l = 0). ``SPLITS`` = 1: all of them."""
    start = lo
    end = hi
    if SPLITS > 1:
        chunk = tl.cdiv(tl.cdiv(hi - lo, SPLITS), BLOCK_N) * BLOCK_N
        start = lo + split * chunk
        end = tl.minimum(start + chunk, hi)
    return start, end


@triton.jit
def _active_splits(lo, hi, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """How many of the ``SPLITS`` splits of :func:`_split_range` hold keys of ``[lo, hi)``; at least
    one (split 0 stores the rows of a tile that sees no key)."""
    if SPLITS == 1:
        return 1
    else:
        chunk = tl.cdiv(tl.cdiv(hi - lo, SPLITS), BLOCK_N) * BLOCK_N
        return tl.maximum(tl.cdiv(hi - lo, tl.maximum(chunk, 1)), 1)


@triton.jit
def _paged_attention_kernel(
    Q, K_cache, V_cache, Out, Partial_acc, Partial_ml, Counters,
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
    SPLITS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, IEEE: tl.constexpr,
    Sinks=None, attn_chunk=0, USE_SINKS: tl.constexpr = False, USE_CHUNK: tl.constexpr = False,
    PDL: tl.constexpr = False,
    Lse=None, key_lo=0, key_hi=0, USE_KEY_RANGE: tl.constexpr = False, STORE_LSE: tl.constexpr = False,
):
    """Program ``(tile, kv_head)`` attends the tile's query rows over their keys ``[lo, hi)``.

    ``USE_SINKS``: per-query-head sink logits ``Sinks`` join each softmax (gpt-oss);
    ``USE_CHUNK``: a query sees the keys of its own ``attn_chunk``-sized block only (Llama-4).
    ``USE_KEY_RANGE``: only the keys at positions ``[key_lo, key_hi)`` (key blocks from ``key_lo``);
    ``STORE_LSE``: each row's log-sum-exp (``m + log l``, ``-inf`` where it saw no key) to
    ``Lse`` ``[T, Hq]`` float32 (both unsplit only: a prefill over a context in parts, merged after).

    ``SPLITS`` > 1 (split-KV, "flash-decoding"; program ``(tile, kv_head, split)``): split
    ``split`` of the keys, in ``SPLITS`` chunks of whole ``BLOCK_N`` blocks sized at run time
    from the context (the last ones empty when the context is short: those programs return at once,
    before the PDL wait). Each split that holds keys stores its partial softmax (row max ``m``, row
    sum ``l``, unnormalized fp32 ``acc``) in the workspace; the last of them to arrive (an int32
    counter, acquire-release at GPU scope after a CTA barrier, as in
    :func:`miles_host.kernels._split_k_triton.split_k_epilogue`) merges the partials in split order
    (deterministic whatever the arrival order), stores the output and resets the counter.
    ``SPLITS`` = 1 leaves the workspace and counters unused.
    """
    pdl_start(PDL)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ROWS: tl.constexpr = BLOCK_M * GROUP_PAD
    seq, q_first, q_end, context, lo, hi = _tile_keys(
        cu_seqlens_q, context_lens, tile_seq, tile_q_start, tile, window, attn_chunk, BLOCK_M, BLOCK_N,
        USE_WINDOW, USE_CHUNK,
    )
    if USE_KEY_RANGE:
        lo = tl.maximum(lo, key_lo)
        hi = tl.minimum(hi, key_hi)
    start, end = _split_range(lo, hi, split, SPLITS, BLOCK_N)
    active = _active_splits(lo, hi, SPLITS, BLOCK_N)
    if split < active:  # a split past the keys does nothing (no wait, store, count)
        pdl_wait(PDL)
        token, head, row_valid, position, q = _tile_queries(
            Q, q_first, q_end, context, kv_head, stride_qt, stride_qh, GROUP, GROUP_PAD, BLOCK_M, D, D_PAD,
        )
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, DV_PAD], tl.float32)
        m_i, l_i, acc = _attend_blocks(
            q, m_i, l_i, acc, K_cache, V_cache, block_tables, seq, kv_head, position, start, end,
            scale, softcap, window,
            stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh, stride_bt,
            PAGE, BLOCK_N, D, D_PAD, DV, DV_PAD, USE_SOFTCAP, USE_WINDOW, IEEE, attn_chunk, USE_CHUNK,
        )
        if SPLITS == 1:
            _store_rows(Out, acc, l_i, token, head, row_valid, stride_ot, stride_oh, DV, DV_PAD, m_i, Sinks,
                        USE_SINKS)
            if STORE_LSE:
                lse = tl.where(l_i > 0.0, m_i + tl.log(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
                tl.store(Lse + token * tl.num_programs(1) * GROUP + head, lse, mask=row_valid)
        else:
            pair = tile * tl.num_programs(1) + kv_head
            _merge_splits(acc, m_i, l_i, Partial_acc, Partial_ml, Counters, pair, split, row_valid,
                          Out, token, head, stride_ot, stride_oh, active, ROWS, DV, DV_PAD, SPLITS, Sinks, USE_SINKS)


@triton.jit
def _merge_splits(
    acc, m_i, l_i, Partial_acc, Partial_ml, Counters, pair, split, row_valid,
    Out, token, head, stride_ot, stride_oh, active,
    ROWS: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, SPLITS: tl.constexpr,
    Sinks=None, USE_SINKS: tl.constexpr = False,
):
    """Split ``split`` of program group ``pair`` stores its partial softmax (row max ``m_i``, row
    sum ``l_i``, unnormalized fp32 ``acc``) in the workspace; the last of the ``active`` splits that
    hold keys (:func:`_active_splits`: the only ones that come here) to arrive (an int32 counter,
    acquire-release at GPU scope after a CTA barrier) merges their partials in split order, stores
    the rows and resets the counter.

    Workspace: acc ``[pairs, SPLITS, ROWS, DV_PAD]``, (m, l) ``[pairs, SPLITS, 2, ROWS]``."""
    rows = tl.arange(0, ROWS)
    dv = tl.arange(0, DV_PAD)
    acc_offs = rows[:, None] * DV_PAD + dv[None, :]
    tl.store(Partial_acc + (pair * SPLITS + split) * (ROWS * DV_PAD) + acc_offs, acc, mask=row_valid[:, None])
    ml = Partial_ml + (pair * SPLITS + split) * (2 * ROWS) + rows
    tl.store(ml, m_i, mask=row_valid)
    tl.store(ml + ROWS, l_i, mask=row_valid)
    tl.debug_barrier()
    arrived = tl.atomic_add(Counters + pair, 1, sem="acq_rel", scope="gpu")
    if arrived == active - 1:
        ml_base = Partial_ml + pair * SPLITS * (2 * ROWS) + rows
        m_max = tl.full([ROWS], float("-inf"), tl.float32)
        for s in tl.static_range(SPLITS):
            m_s = tl.load(ml_base + s * (2 * ROWS), mask=row_valid & (s < active), other=float("-inf"),
                          cache_modifier=".cg")
            m_max = tl.maximum(m_max, m_s)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        total_l = tl.zeros([ROWS], tl.float32)
        total = tl.zeros([ROWS, DV_PAD], tl.float32)
        for s in tl.static_range(SPLITS):
            rows_s = row_valid & (s < active)
            m_s = tl.load(ml_base + s * (2 * ROWS), mask=rows_s, other=float("-inf"), cache_modifier=".cg")
            l_s = tl.load(ml_base + s * (2 * ROWS) + ROWS, mask=rows_s, other=0.0, cache_modifier=".cg")
            weight = tl.exp(m_s - m_max)                   # 0 for an empty split (m_s = -inf)
            part = tl.load(  # an active split stored its rows (zeros where it saw no key): no wait on m_s
                Partial_acc + (pair * SPLITS + s) * (ROWS * DV_PAD) + acc_offs,
                mask=rows_s[:, None], other=0.0, cache_modifier=".cg",
            )
            total_l += weight * l_s
            total += weight[:, None] * part
        _store_rows(Out, total, total_l, token, head, row_valid, stride_ot, stride_oh, DV, DV_PAD,
                    m_max, Sinks, USE_SINKS)
        tl.atomic_xchg(Counters + pair, 0, sem="relaxed", scope="gpu")


@triton.jit
def _to_cache(x, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """``x`` as ``DTYPE``, rounding to nearest even as ``torch.Tensor.to`` (exact via float32)."""
    if x.dtype == DTYPE:
        return x
    else:
        return cast_rne(x.to(tl.float32), DTYPE, EMULATE)


@triton.jit
def _kv_write_kernel(
    K, V, K_cache, V_cache, slots,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcs, stride_kch, stride_vcs, stride_vch,
    H, D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr = False,
):
    """K and V rows of token ``program_id(0)`` (heads of block ``program_id(1)``) into its cache slot."""
    pdl_start(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    slot = tl.load(slots + t).to(tl.int64)
    d = tl.arange(0, D_PAD)
    mask = (heads[:, None] < H) & (d[None, :] < D)
    k = tl.load(K + t * stride_kt + heads[:, None] * stride_kh + d[None, :], mask=mask)
    tl.store(K_cache + slot * stride_kcs + heads[:, None] * stride_kch + d[None, :],
             _to_cache(k, K_cache.dtype.element_ty, EMULATE), mask=mask)
    dv = tl.arange(0, DV_PAD)
    mask_v = (heads[:, None] < H) & (dv[None, :] < DV)
    v = tl.load(V + t * stride_vt + heads[:, None] * stride_vh + dv[None, :], mask=mask_v)
    tl.store(V_cache + slot * stride_vcs + heads[:, None] * stride_vch + dv[None, :],
             _to_cache(v, V_cache.dtype.element_ty, EMULATE), mask=mask_v)


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


def decode_splits(num_tiles: int, num_kv_heads: int, device: torch.device,
                  programs_per_sm: int | None = None) -> int:
    """KV splits of a decode launch of ``num_tiles`` x ``num_kv_heads`` programs.

    From the grid alone, never from context lengths (a CUDA graph replays the launch as
    the contexts grow): the largest power of two up to :data:`MAX_DECODE_SPLITS` that keeps
    the grid within ``programs_per_sm`` (default :data:`DECODE_PROGRAMS_PER_SM`) programs per
    SM; 1 (the unsplit kernel) once the grid fills the SMs. Batch 1 of 8 KV heads on an H200
    (132 SMs): 16 splits.
    """
    programs_per_sm = programs_per_sm or DECODE_PROGRAMS_PER_SM
    programs = num_tiles * num_kv_heads
    if device.type == "cuda":
        sms = split_k.num_sms(device.index if device.index is not None else torch.cuda.current_device())
    else:  # the CPU interpreter (tests): as on an H200
        sms = DEFAULT_SMS
    splits = 1
    if programs < sms:
        while splits * 2 <= MAX_DECODE_SPLITS and programs * splits * 2 <= programs_per_sm * sms:
            splits *= 2
    return splits


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
    splits: int | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    key_range: tuple[int, int] | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`~miles_host.rollout.attention.paged_attention_reference`.

    ``meta.tile_seq``/``meta.tile_q_start`` must come from :func:`build_tiles` with
    :func:`tokens_per_tile` tokens per tile (the model runner builds them).

    ``invariant`` (``--true-on-policy``): one tile shape (``DECODE_ROWS`` rows x
    ``KEYS_PER_ITERATION`` keys, 4 warps) whatever the step or page size, so a query's
    result depends only on its own context: its key blocks start at position 0 (or
    at a multiple of the block below its window), blocks past its own position add
    exact zeros, and keys are never split across programs.

    Otherwise a decode step splits each tile's keys over ``splits`` programs
    (:func:`decode_splits` when None) merged in the same launch; 1 does not split.

    ``sinks``: ``[Hq]`` sink logits (an extra softmax column, dropped); ``chunk_size``:
    chunked local attention (a query sees the keys of its own chunk).

    ``key_range`` ``(lo, hi)``: only the keys at positions ``[lo, hi)`` (block-table entries outside
    the range are never read);
    ``return_lse``: also each row's log-sum-exp ``[T, Hq]`` (float32): a prefill step attended over its
    context in parts, merged by :func:`~miles_host.rollout.attention.merge_attention_states`. Neither
    splits keys, nor takes sinks.
    """
    num_tokens, num_q_heads, head_dim = q_THD.shape
    _, page, num_kv_heads, _ = k_cache_NSHD.shape
    head_dim_v = v_cache_NSHD.shape[-1]
    group = num_q_heads // num_kv_heads
    block_m = tokens_per_tile(num_q_heads, num_kv_heads, meta.is_decode, invariant)
    out = torch.empty(num_tokens, num_q_heads, head_dim_v, dtype=q_THD.dtype, device=q_THD.device)
    q_THD = q_THD.contiguous()
    num_tiles = meta.tile_seq.shape[0]
    # a whole number of pages (powers of two); fixed in invariant mode (any page size works)
    block_n = KEYS_PER_ITERATION if invariant else max(KEYS_PER_ITERATION, page)
    group_pad, dv_pad = _next_pow2(group), max(16, _next_pow2(head_dim_v))
    args = (
        meta.block_tables_BM, meta.context_lens_B, meta.cu_seqlens_q, meta.tile_seq, meta.tile_q_start,
        float(scale), float(logit_softcap or 1.0), int(sliding_window or 0),
        q_THD.stride(0), q_THD.stride(1),
        k_cache_NSHD.stride(0), k_cache_NSHD.stride(1), k_cache_NSHD.stride(2),
        v_cache_NSHD.stride(0), v_cache_NSHD.stride(1), v_cache_NSHD.stride(2),
        out.stride(0), out.stride(1),
        meta.block_tables_BM.stride(0),
    )
    constexprs = dict(
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m,
        PAGE=page, BLOCK_N=block_n,
        D=head_dim, D_PAD=max(16, _next_pow2(head_dim)), DV=head_dim_v, DV_PAD=dv_pad,
        USE_SOFTCAP=logit_softcap is not None, USE_WINDOW=sliding_window is not None,
        IEEE=q_THD.dtype == torch.float32,
        num_warps=4, num_stages=2,
    )
    in_parts = key_range is not None or return_lse
    if in_parts and (sinks is not None or invariant or splits not in (None, 1)):
        raise ValueError("a key range or the log-sum-exp output: unsplit, without sinks, not in invariant mode")
    if in_parts:
        splits = 1
    elif meta.is_decode and not invariant:
        if splits is None:
            splits = decode_splits(num_tiles, num_kv_heads, q_THD.device)
    else:
        splits = 1
    if splits == 1:  # no workspace: placeholders the kernel never reads
        partial_acc = partial_ml = counters = out
    else:  # partial softmax of every (tile, kv head, split): acc rows, then (m, l) rows
        rows, pairs = block_m * group_pad, num_tiles * num_kv_heads
        workspace = torch.empty(pairs * splits * rows * (dv_pad + 2), dtype=torch.float32, device=q_THD.device)
        partial_acc, partial_ml = workspace.split([pairs * splits * rows * dv_pad, pairs * splits * rows * 2])
        counters = split_k.semaphores(q_THD.device, pairs)
        constexprs["BLOCK_N"] = max(DECODE_SPLIT_KEYS, page)
    if sinks is not None or chunk_size is not None:
        constexprs.update(USE_SINKS=sinks is not None, USE_CHUNK=chunk_size is not None)
        sinks = sinks.float().contiguous() if sinks is not None else out
        constexprs.update(Sinks=sinks, attn_chunk=int(chunk_size or 0))
    lse = None
    if in_parts:
        lse = torch.empty(num_tokens, num_q_heads, dtype=torch.float32, device=q_THD.device)
        key_lo, key_hi = key_range if key_range is not None else (0, 2**31 - 1)
        constexprs.update(Lse=lse, key_lo=int(key_lo), key_hi=int(key_hi), USE_KEY_RANGE=key_range is not None,
                          STORE_LSE=True)
    _paged_attention_kernel[(num_tiles, num_kv_heads, splits)](
        q_THD, k_cache_NSHD, v_cache_NSHD, out, partial_acc, partial_ml, counters, *args,
        SPLITS=splits, **constexprs, **pdl.options(q_THD),
    )
    return (out, lse) if return_lse else out


#: cache and k/v dtypes the fused KV write handles (others: ``index_copy_``)
KV_WRITE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def write_kv_cache(
    k_cache_NSHD: torch.Tensor, v_cache_NSHD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor,
    slot_mapping_T: torch.Tensor,
) -> None:
    """Store ``k_THD``/``v_THD`` at their slots of the caches, cast to the cache dtype, in one kernel.

    Bit for bit the two ``index_copy_`` of the flattened ``[N * S, H, D]`` caches it replaces
    (a copy and a round-to-nearest-even cast, as ``Tensor.to``); other dtypes fall back to them.
    """
    k_flat = k_cache_NSHD.view(-1, *k_cache_NSHD.shape[2:])
    v_flat = v_cache_NSHD.view(-1, *v_cache_NSHD.shape[2:])
    num_tokens, num_heads, head_dim = k_THD.shape
    head_dim_v = v_THD.shape[-1]
    if num_tokens == 0:
        return
    if any(t.dtype not in KV_WRITE_DTYPES for t in (k_flat, v_flat, k_THD, v_THD)):
        k_flat.index_copy_(0, slot_mapping_T, k_THD.to(k_flat.dtype))
        v_flat.index_copy_(0, slot_mapping_T, v_THD.to(v_flat.dtype))
        return
    if k_THD.stride(-1) != 1:
        k_THD = k_THD.contiguous()
    if v_THD.stride(-1) != 1:
        v_THD = v_THD.contiguous()
    d_pad, dv_pad = _next_pow2(head_dim), _next_pow2(head_dim_v)
    block_h = min(_next_pow2(num_heads), max(1, KV_WRITE_ELEMENTS // max(d_pad, dv_pad)))
    _kv_write_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        k_THD, v_THD, k_flat, v_flat, slot_mapping_T,
        k_THD.stride(0), k_THD.stride(1), v_THD.stride(0), v_THD.stride(1),
        k_flat.stride(0), k_flat.stride(1), v_flat.stride(0), v_flat.stride(1),
        num_heads, D=head_dim, D_PAD=d_pad, DV=head_dim_v, DV_PAD=dv_pad,
        BLOCK_H=block_h, EMULATE=emulate_rounding(), num_warps=4, **pdl.options(k_THD),
    )
