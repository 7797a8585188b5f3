"""Decode-shape weight-only INT4 GEMM (Triton) on the ``halves`` layout of :mod:`miles_int4.kernels`.

``y = x @ w_dq^T`` for ``x [M, K]`` bf16/fp16 with M <= 64, ``w_dq`` the QAT
forward's dequantized weight ``(fp32(q) * fp32(scale)).to(x.dtype)``, fp32
accumulation, output in ``x``'s dtype: the numbers of
:func:`miles_int4.kernels.reference_mm` up to the order of the fp32 sums.

Design (the packed weight, 0.5 byte per weight, is streamed once from HBM):

- grid ``(cdiv(N, BLOCK_N), SPLIT_K)``: a program owns ``BLOCK_N`` weight rows and
  a run of scale groups; SPLIT_K from :func:`miles_host.kernels.split_k.plan_split_k`
  (about two programs per SM), partial tiles reduced by the last program of each
  tile in split order (deterministic);
- per group of ``gs`` input columns: one ``[BLOCK_N, gs/2]`` byte tile (``gs/2``
  contiguous bytes per row) and the ``[BLOCK_N]`` scales; the low nibbles are
  columns ``0 .. gs/2-1`` of the group and the high nibbles the rest, so the two
  halves dequantize without any shuffle and multiply the activation columns of
  their half: two tensor-core ``dot`` s into one fp32 accumulator;
- dequantization without an int-to-float conversion (:func:`_dequantize`): the nibble
  OR-ed into the mantissa of a power of two, minus that power of two plus 8, is ``q``
  exactly; ``q * scale`` rounds once to bf16 (packed bf16x2 multiplies on the GPU), as
  the QAT forward rounds it;
- the weight is the MMA's M side (``dot(w [BLOCK_N, gs/2], x^T [gs/2, BLOCK_M])``),
  so 1..16 tokens pad only to 16; a fixed tile table by M, no autotuning (the
  same launch in every captured CUDA graph).

Tensor legend: M tokens, N out features, K in features, G = K / gs scale groups.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from miles_host.kernels import split_k
from miles_host.kernels.split_k import SmallMConfig
from miles_host.kernels._split_k_triton import cast_rne, dot, emulate_rounding, split_k_epilogue

MAX_M = 64
#: float32 bits of 2^23 (a nibble OR-ed into its mantissa gives 2^23 + nibble exactly)
_MAGIC_BITS = tl.constexpr(0x4B000000)
#: 2^23 + 8: subtracting it leaves q = nibble - 8
_MAGIC_OFFSET = tl.constexpr(8388616.0)


def small_m_config(m: int) -> SmallMConfig:
    """The fixed tile table (dequantization costs the same whatever M, so N tiles stay 64 wide)."""
    return SmallMConfig(block_m=split_k.block_m_for(m), block_n=64, num_warps=4, num_stages=4)


@triton.jit
def _dequantize(nibble, scale, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """int16 nibbles ``[R, C]`` (``q + 8``), bf16 scales ``[R]`` -> ``DTYPE(fp32(q) * fp32(scale))``.

    bf16 on the GPU: ``0x4300 | nibble`` is the bf16 ``128 + nibble``, minus 136 gives
    ``q`` exactly, and the bf16 product ``q * scale`` rounds the exact product once to
    nearest even (PTX ``mul.bf16x2``: two weights per instruction), the QAT formula's
    number. Otherwise (float16, or the interpreter, whose bf16 arithmetic is integer
    arithmetic on the raw bits) the same in float32: ``0x4B000000 | nibble`` is
    ``2^23 + nibble``, the product is exact, one rounding to ``DTYPE``.
    """
    if EMULATE or DTYPE != tl.bfloat16:
        q = (nibble.to(tl.int32) | _MAGIC_BITS).to(tl.float32, bitcast=True) - _MAGIC_OFFSET
        return cast_rne(q * scale.to(tl.float32)[:, None], DTYPE, EMULATE)
    else:
        q = (nibble | 0x4300).to(tl.bfloat16, bitcast=True) - 136.0
        return q * scale[:, None]


@triton.jit
def _int4_small_m_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, sem_ptr,
    M, N, stride_xm, stride_wn, stride_sn, stride_ym,
    GROUPS_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, REDUCE_IN_KERNEL: tl.constexpr,
    EMULATE: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, HALF: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, HALF)
    mask_n = offs_n < N
    mask_m = offs_m < M
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_h[None, :]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_h[None, :]
    s_ptrs = s_ptr + offs_n.to(tl.int64) * stride_sn
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(GROUPS_PER_SPLIT):
        group = pid_k * GROUPS_PER_SPLIT + step
        if EVEN_N:
            packed = tl.load(w_ptrs + group * HALF).to(tl.int16)
            scale = tl.load(s_ptrs + group)
        else:
            packed = tl.load(w_ptrs + group * HALF, mask=mask_n[:, None], other=0).to(tl.int16)
            scale = tl.load(s_ptrs + group, mask=mask_n, other=0.0)
        x_low = tl.load(x_ptrs + group * GROUP, mask=mask_m[:, None], other=0.0)
        x_high = tl.load(x_ptrs + group * GROUP + HALF, mask=mask_m[:, None], other=0.0)
        acc = dot(_dequantize(packed & 0xF, scale, dtype, EMULATE), tl.trans(x_low), acc, EMULATE)
        acc = dot(_dequantize(packed >> 4, scale, dtype, EMULATE), tl.trans(x_high), acc, EMULATE)
    y_offs = offs_m[None, :] * stride_ym + offs_n[:, None]
    part_offs = offs_m[None, :] * N + offs_n[:, None]
    mask = mask_n[:, None] & mask_m[None, :]
    split_k_epilogue(acc, y_ptr, part_ptr, sem_ptr, y_offs, part_offs, mask, pid_n, pid_k, M * N,
                     SPLIT_K, REDUCE_IN_KERNEL, EMULATE)


def int4_small_m_mm(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int,
    out_dtype: torch.dtype | None = None, config: SmallMConfig | None = None, split: int | None = None,
) -> torch.Tensor:
    """``x [M, K] @ w_dq^T`` with ``w`` as ``halves`` bytes ``[N, K/2]`` and bf16 ``scale [N, K/gs]``; M <= 64.

    ``out_dtype`` defaults to ``x.dtype``; ``config`` and ``split`` override the
    fixed table (benchmarks). CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``.
    """
    m, k = x.shape
    n = packed.shape[0]
    if m > MAX_M or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"int4 small-M GEMM takes <= {MAX_M} bf16/fp16 rows, got {tuple(x.shape)} {x.dtype}")
    if tuple(packed.shape) != (n, k // 2) or packed.dtype != torch.uint8 or tuple(scale.shape) != (n, k // group_size):
        raise ValueError(f"int4 small-M GEMM: packed {tuple(packed.shape)} {packed.dtype} / scale {tuple(scale.shape)} "
                         f"do not fit x {tuple(x.shape)} with group size {group_size}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    packed = packed if packed.stride(-1) == 1 else packed.contiguous()
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or small_m_config(m)
    assert cfg.block_m >= m, cfg
    n_tiles, groups = triton.cdiv(n, cfg.block_n), k // group_size
    if split is None:
        sms = split_k.num_sms(x.device.index or 0) if x.is_cuda else 132
        plan = split_k.plan_split_k(m, n_tiles, groups, k // 2 + 2 * groups, sms)
    else:
        plan = split_k.fixed_split(n_tiles, groups, split)
    partials, counters, in_kernel = split_k.workspace(plan, m, n, x.device, out)
    _int4_small_m_kernel[(plan.n_tiles, plan.split_k)](
        x, packed, scale, out, partials, counters,
        m, n, x.stride(0), packed.stride(0), scale.stride(0), out.stride(0),
        GROUPS_PER_SPLIT=plan.blocks_per_split, SPLIT_K=plan.split_k, REDUCE_IN_KERNEL=in_kernel,
        EMULATE=emulate_rounding(), EVEN_N=n % cfg.block_n == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        GROUP=group_size, HALF=group_size // 2, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not in_kernel:
        out.copy_(partials.sum(dim=0))
    return out
