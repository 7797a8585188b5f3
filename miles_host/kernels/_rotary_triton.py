"""Triton body of :mod:`miles_host.kernels.rotary` (imported only on CUDA).

One program per (token, head); query heads first, then key heads. Every
product and sum is rounded to the activation dtype where the eager code
rounds, so results equal the eager forward up to the norm's reduction order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_host.kernels import pdl
from miles_host.kernels._triton_common import TL_DTYPES, cast, pdl_start, pdl_wait, round_to


_round = round_to


@triton.jit
def _normed(x, w, rstd, HAS_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, DTYPE: tl.constexpr):
    if HAS_NORM:
        if UNIT_OFFSET:
            return _round(x * rstd * (1.0 + w), DTYPE)
        return _round(_round(x * rstd, DTYPE) * w, DTYPE)
    return x


@triton.jit
def _qk_norm_rope_kernel(
    Q, K, QW, KW, Cos, Sin, QOut, KOut, V, KCache, VCache, Slots,
    stride_q, stride_k, stride_c, stride_v, stride_kcs, stride_kch, stride_vcs, stride_vch,
    num_q_heads, eps,
    D: tl.constexpr, BLOCK_D: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
    PASS: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, INTERLEAVED: tl.constexpr, DTYPE: tl.constexpr,
    STORE_KV: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Program ``(token, head)``: query heads first, then key heads. ``STORE_KV``: a key head's
    program writes its rotated key, and the token's value row of that head, to the paged cache
    at the token's slot instead of ``KOut`` (the engine's KV write, in the same launch)."""
    pdl_start(PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)
    is_key = head >= num_q_heads
    kv_head = head - num_q_heads
    if is_key:
        src = K + token * stride_k + kv_head * D
        weight = KW
    else:
        src = Q + token * stride_q + head * D
        weight = QW

    i = tl.arange(0, BLOCK_R)
    rmask = i < R
    if INTERLEAVED:
        i1 = 2 * i
        i2 = 2 * i + 1
    else:
        i1 = i
        i2 = i + R
    w1 = 0.0
    w2 = 0.0
    if HAS_NORM:  # norm weights first: no earlier kernel writes them (programmatic dependent launch)
        w1 = tl.load(weight + i1, mask=rmask, other=0.0).to(tl.float32)
        w2 = tl.load(weight + i2, mask=rmask, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    if is_key:
        if STORE_KV:
            slot = tl.load(Slots + token).to(tl.int64)
            dst = KCache + slot * stride_kcs + kv_head * stride_kch
            d = tl.arange(0, BLOCK_D)
            value = tl.load(V + token * stride_v + kv_head * D + d, mask=d < D)
            tl.store(VCache + slot * stride_vcs + kv_head * stride_vch + d, value, mask=d < D)
        else:
            dst = KOut + (token * (tl.num_programs(1) - num_q_heads) + kv_head) * D
    else:
        dst = QOut + (token * num_q_heads + head) * D
    rstd = 1.0
    if HAS_NORM:
        d = tl.arange(0, BLOCK_D)
        x = tl.load(src + d, mask=d < D, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    x1 = tl.load(src + i1, mask=rmask, other=0.0).to(tl.float32)
    x2 = tl.load(src + i2, mask=rmask, other=0.0).to(tl.float32)
    x1 = _normed(x1, w1, rstd, HAS_NORM, UNIT_OFFSET, DTYPE)
    x2 = _normed(x2, w2, rstd, HAS_NORM, UNIT_OFFSET, DTYPE)
    cos = tl.load(Cos + token * stride_c + i, mask=rmask, other=0.0).to(tl.float32)
    sin = tl.load(Sin + token * stride_c + i, mask=rmask, other=0.0).to(tl.float32)
    out1 = _round(_round(x1 * cos, DTYPE) - _round(x2 * sin, DTYPE), DTYPE)
    out2 = _round(_round(x2 * cos, DTYPE) + _round(x1 * sin, DTYPE), DTYPE)
    tl.store(dst + i, cast(out1, DTYPE), mask=rmask)
    tl.store(dst + R + i, cast(out2, DTYPE), mask=rmask)
    if PASS > 0:
        p = tl.arange(0, BLOCK_P)
        pmask = p < PASS
        xp = tl.load(src + 2 * R + p, mask=pmask, other=0.0).to(tl.float32)
        wp = 0.0
        if HAS_NORM:
            wp = tl.load(weight + 2 * R + p, mask=pmask, other=0.0).to(tl.float32)
        xp = _normed(xp, wp, rstd, HAS_NORM, UNIT_OFFSET, DTYPE)
        tl.store(dst + 2 * R + p, cast(xp, DTYPE), mask=pmask)


def qk_norm_rope(q_TC, k_TC, num_q_heads, num_kv_heads, head_dim, cos_TR, sin_TR,
                 q_weight, k_weight, eps, unit_offset, interleaved, kv_store=None):
    """``kv_store``: ``(v_TC, k_cache_XHD, v_cache_XHD, slots_T)`` (caches flattened over their
    slots, the activations' dtype): keys and values go to the cache and ``k_out`` is None."""
    num_tokens = q_TC.shape[0]
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q_TC.dtype, device=q_TC.device)
    k_out = None if kv_store is not None else torch.empty((num_tokens, num_kv_heads, head_dim), dtype=q_TC.dtype,
                                                          device=q_TC.device)
    if num_tokens == 0:
        return q_out, k_out
    half = cos_TR.shape[-1]
    passthrough = head_dim - 2 * half
    has_norm = q_weight is not None
    v_TC, k_cache, v_cache, slots = kv_store if kv_store is not None else (q_TC, q_out, q_out, q_out)
    _qk_norm_rope_kernel[(num_tokens, num_q_heads + num_kv_heads)](
        q_TC, k_TC, q_weight if has_norm else q_TC, k_weight if has_norm else k_TC,
        cos_TR, sin_TR, q_out, k_out if k_out is not None else q_out, v_TC, k_cache, v_cache, slots,
        q_TC.stride(0), k_TC.stride(0), cos_TR.stride(0), v_TC.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        num_q_heads, eps,
        D=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        R=half, BLOCK_R=triton.next_power_of_2(max(half, 1)),
        PASS=passthrough, BLOCK_P=triton.next_power_of_2(max(passthrough, 1)),
        HAS_NORM=has_norm, UNIT_OFFSET=unit_offset, INTERLEAVED=interleaved, DTYPE=TL_DTYPES[q_TC.dtype],
        STORE_KV=kv_store is not None, num_warps=1, **pdl.options(q_TC),
    )
    return q_out, k_out
