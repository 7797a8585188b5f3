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
    Q, K, QW, KW, Cos, Sin, QOut, KOut,
    stride_q, stride_k, stride_c,
    num_q_heads, eps,
    D: tl.constexpr, BLOCK_D: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
    PASS: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, INTERLEAVED: tl.constexpr, DTYPE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)
    if head < num_q_heads:
        src = Q + token * stride_q + head * D
        weight = QW
        dst = QOut + (token * num_q_heads + head) * D
    else:
        num_kv_heads = tl.num_programs(1) - num_q_heads
        src = K + token * stride_k + (head - num_q_heads) * D
        weight = KW
        dst = KOut + (token * num_kv_heads + head - num_q_heads) * D

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
                 q_weight, k_weight, eps, unit_offset, interleaved):
    num_tokens = q_TC.shape[0]
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q_TC.dtype, device=q_TC.device)
    k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=q_TC.dtype, device=q_TC.device)
    if num_tokens == 0:
        return q_out, k_out
    half = cos_TR.shape[-1]
    passthrough = head_dim - 2 * half
    has_norm = q_weight is not None
    _qk_norm_rope_kernel[(num_tokens, num_q_heads + num_kv_heads)](
        q_TC, k_TC, q_weight if has_norm else q_TC, k_weight if has_norm else k_TC,
        cos_TR, sin_TR, q_out, k_out,
        q_TC.stride(0), k_TC.stride(0), cos_TR.stride(0),
        num_q_heads, eps,
        D=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        R=half, BLOCK_R=triton.next_power_of_2(max(half, 1)),
        PASS=passthrough, BLOCK_P=triton.next_power_of_2(max(passthrough, 1)),
        HAS_NORM=has_norm, UNIT_OFFSET=unit_offset, INTERLEAVED=interleaved, DTYPE=TL_DTYPES[q_TC.dtype],
        num_warps=1, **pdl.options(q_TC),
    )
    return q_out, k_out
