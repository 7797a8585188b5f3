"""Triton kernels of DeepSeek Sparse Attention over the paged cache (GPU; needs triton).

- :func:`index_scores_triton`: one program per (token, block of keys) computes the lightning
  indexer's scores of those keys with one ``[I, D] x [D, keys]`` product (indexer heads padded
  to 16 rows for ``tl.dot``, IEEE float32 for float32 inputs), ``relu``, the per-head weights
  and ``-inf`` past the token's position.
- :func:`sparse_attention_triton`: one program per (token, head) streams the token's selected
  keys in chunks through the block table with an online softmax (``-1`` entries skipped).

:mod:`miles_host.kernels.dsa` holds the plain-PyTorch references they are tested against
(``tests/kernels/interpreted_dsa.py`` on CPU, ``tests/kernels/test_dsa.py`` on a GPU).

Tensor legend: T tokens, B sequences, M blocks per sequence, N blocks, S slots per block,
H heads, I indexer heads, D head dim, L keys, K selected keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KEYS_PER_PROGRAM = 64   # indexer keys scored by one program
SELECTED_PER_ITERATION = 32   # selected keys one attention iteration reads


@triton.jit
def _index_scores_kernel(
    Q, W, KI, block_tables, seq_T, pos_T, Out, scale, num_keys, block_size,
    stride_qt, stride_qi, stride_wt, stride_kslot, stride_bt, stride_ot,
    NUM_I: tl.constexpr, I_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_L: tl.constexpr, IEEE: tl.constexpr,
):
    t = tl.program_id(0)
    keys = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    seq = tl.load(seq_T + t)
    pos = tl.load(pos_T + t)
    heads = tl.arange(0, I_PAD)
    dims = tl.arange(0, D_PAD)
    q = tl.load(Q + t * stride_qt + heads[:, None] * stride_qi + dims[None, :],
                mask=(heads[:, None] < NUM_I) & (dims[None, :] < D), other=0.0)
    w = tl.load(W + t * stride_wt + heads, mask=heads < NUM_I, other=0.0).to(tl.float32)
    in_range = keys < num_keys
    visible = in_range & (keys <= pos)
    block = tl.load(block_tables + seq * stride_bt + keys // block_size, mask=visible, other=0)
    slots = block.to(tl.int64) * block_size + keys % block_size
    k = tl.load(KI + slots[:, None] * stride_kslot + dims[None, :],
                mask=visible[:, None] & (dims[None, :] < D), other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.maximum(s * scale, 0.0)
    score = tl.sum(s * w[:, None], axis=0)
    score = tl.where(visible, score, float("-inf"))
    tl.store(Out + t * stride_ot + keys, score, mask=in_range)


def index_scores_triton(q_TID, w_TI, k_index_NS1D, block_tables_BM, seq_T, pos_T, max_keys: int, scale: float):
    """Triton form of :func:`miles_host.kernels.dsa.index_scores_reference`."""
    num_tokens, num_heads, dim = q_TID.shape
    out = torch.empty(num_tokens, max_keys, dtype=torch.float32, device=q_TID.device)
    if num_tokens == 0 or max_keys == 0:
        return out
    q = q_TID.contiguous()
    keys = k_index_NS1D.reshape(-1, dim)
    if keys.dtype != q.dtype:
        keys = keys.to(q.dtype)
    w = w_TI.float().contiguous()
    tables = block_tables_BM.contiguous()
    grid = (num_tokens, triton.cdiv(max_keys, KEYS_PER_PROGRAM))
    _index_scores_kernel[grid](
        q, w, keys, tables, seq_T.contiguous(), pos_T.contiguous(), out, float(scale), max_keys,
        k_index_NS1D.shape[1],
        q.stride(0), q.stride(1), w.stride(0), keys.stride(0), tables.stride(0), out.stride(0),
        NUM_I=num_heads, I_PAD=max(16, triton.next_power_of_2(num_heads)), D=dim,
        D_PAD=max(16, triton.next_power_of_2(dim)), BLOCK_L=KEYS_PER_PROGRAM, IEEE=q.dtype == torch.float32,
    )
    return out


@triton.jit
def _sparse_attention_kernel(
    Q, Kc, Vc, block_tables, seq_T, Sel, Out, scale, num_selected, block_size,
    stride_qt, stride_qh, stride_kslot, stride_kh, stride_vslot, stride_vh, stride_bt, stride_st,
    stride_ot, stride_oh,
    DK: tl.constexpr, DK_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(seq_T + t)
    dk = tl.arange(0, DK_PAD)
    dv = tl.arange(0, DV_PAD)
    q = tl.load(Q + t * stride_qt + h * stride_qh + dk, mask=dk < DK, other=0.0).to(tl.float32)
    m_i = tl.max(tl.zeros([BLOCK_K], dtype=tl.float32), axis=0) - 1.0e30
    l_i = tl.sum(tl.zeros([BLOCK_K], dtype=tl.float32), axis=0)
    acc = tl.zeros([DV_PAD], dtype=tl.float32)
    start = 0
    while start < num_selected:  # (a runtime-bound range() does not run under the interpreter with numpy 2)
        idx = start + tl.arange(0, BLOCK_K)
        pos = tl.load(Sel + t * stride_st + idx, mask=idx < num_selected, other=-1)
        valid = pos >= 0
        safe = tl.where(valid, pos, 0)
        block = tl.load(block_tables + seq * stride_bt + safe // block_size, mask=valid, other=0)
        slots = block.to(tl.int64) * block_size + safe % block_size
        k = tl.load(Kc + slots[:, None] * stride_kslot + h * stride_kh + dk[None, :],
                    mask=valid[:, None] & (dk[None, :] < DK), other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(Vc + slots[:, None] * stride_vslot + h * stride_vh + dv[None, :],
                    mask=valid[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
        start += BLOCK_K
    out = acc / l_i
    tl.store(Out + t * stride_ot + h * stride_oh + dv, out.to(Out.dtype.element_ty), mask=dv < DV)


def sparse_attention_triton(q_THD, k_cache_NSHD, v_cache_NSHD, block_tables_BM, seq_T, positions_TK, scale: float):
    """Triton form of :func:`miles_host.kernels.dsa.sparse_attention_reference`."""
    num_tokens, num_heads, dk = q_THD.shape
    dv = v_cache_NSHD.shape[-1]
    out = torch.empty(num_tokens, num_heads, dv, dtype=q_THD.dtype, device=q_THD.device)
    if num_tokens == 0:
        return out
    q = q_THD.contiguous()
    keys = k_cache_NSHD.reshape(-1, *k_cache_NSHD.shape[2:])
    values = v_cache_NSHD.reshape(-1, *v_cache_NSHD.shape[2:])
    selected = positions_TK.contiguous()
    tables = block_tables_BM.contiguous()
    _sparse_attention_kernel[(num_tokens, num_heads)](
        q, keys, values, tables, seq_T.contiguous(), selected, out, float(scale), selected.shape[1],
        k_cache_NSHD.shape[1],
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        tables.stride(0), selected.stride(0), out.stride(0), out.stride(1),
        DK=dk, DK_PAD=triton.next_power_of_2(dk), DV=dv, DV_PAD=triton.next_power_of_2(dv),
        BLOCK_K=SELECTED_PER_ITERATION,
    )
    return out
