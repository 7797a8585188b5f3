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

One token (batch-1 decode) takes a CUDA-core GEMV instead (:func:`_int4_gemv_kernel`,
``--int4-gemv 0`` turns it off): the same bytes read as int32 words, each word's
eight weights dequantized two at a time (``lop3`` into the bf16 pair ``128 + nibble``,
``sub.bf16x2``, ``mul.bf16x2``: the same bf16 weights) and multiplied into fp32 lanes
by FMAs in inline PTX, the next group's words requested before this group's arithmetic.
No padding of one token to 16 MMA rows, no shared-memory round trip of the operands
(its timing against the tensor-core kernel and bf16: ``bench/RESULTS.md``, INT4 rollout decode).

Both kernels read the bytes row by row (``[N, K/2]``) or in the tiles the rollout stores
(:func:`miles_int4.kernels.tile_halves`: 128 rows' bytes of one group in one contiguous 8 KB run
at group 128, instead of 128 runs of 64 bytes a row apart): the addresses come from
:func:`_row_offsets` and a group stride, the arithmetic is the same; the tiles are the faster layout on the H200
(``bench/history/2026-12-01-5.md``).

Tensor legend: M tokens, N out features, K in features, G = K / gs scale groups.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_host.kernels import split_k, switches
from miles_host.kernels.split_k import SmallMConfig
from miles_host.kernels.triton_common import cast_rne, dot, emulate_rounding, split_k_epilogue
from miles_int4 import kernel_switches

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
def _row_offsets(offs_n, TILE: tl.constexpr, stride_tile, stride_row):
    """Element offset of each row's first group: ``(r // TILE) stride_tile + (r % TILE) stride_row`` (int64)."""
    return (offs_n // TILE).to(tl.int64) * stride_tile + (offs_n % TILE) * stride_row


@triton.jit
def _int4_small_m_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, sem_ptr,
    M, N, stride_xm, stride_tile, stride_row, stride_group, stride_sn, stride_ym,
    GROUPS_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, REDUCE_IN_KERNEL: tl.constexpr,
    EMULATE: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, HALF: tl.constexpr, TILE: tl.constexpr,
):
    """Byte ``h`` of group ``g`` of row ``r`` at :func:`_row_offsets` ``+ g stride_group + h`` (rows or tiles)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, HALF)
    mask_n = offs_n < N
    mask_m = offs_m < M
    w_ptrs = w_ptr + _row_offsets(offs_n, TILE, stride_tile, stride_row)[:, None] + offs_h[None, :]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_h[None, :]
    s_ptrs = s_ptr + offs_n.to(tl.int64) * stride_sn
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(GROUPS_PER_SPLIT):
        group = pid_k * GROUPS_PER_SPLIT + step
        if EVEN_N:
            packed = tl.load(w_ptrs + group * stride_group).to(tl.int16)
            scale = tl.load(s_ptrs + group)
        else:
            packed = tl.load(w_ptrs + group * stride_group, mask=mask_n[:, None], other=0).to(tl.int16)
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


# ----------------------------------------------------------------------------- M = 1: CUDA-core GEMV

# The GEMV's word order: input ``j`` of :func:`_word_dot` is column ``half * HALF + 4 w + byte`` of word ``w``
# (bytes ``4w .. 4w+3`` of a group's ``halves`` bytes) with ``half = (j // 2) % 2``, ``byte = 2 (j % 2) + j // 4``:
# pair ``s`` = ``(word >> 4 s) & 0x000F000F`` holds the low (s even) or high (s odd) nibbles of bytes
# ``s // 2`` and ``s // 2 + 2`` in its two 16-bit halves.


def _word_dot_ptx() -> str:
    """The PTX of :func:`_word_dot`: per pair ``s`` (0..3) of the word in ``$1``, the bf16 pair
    ``128 + nibble`` (``lop3``), ``q`` (``- 136``), ``q * scale`` (``$2``: the scale in both halves),
    both halves widened to fp32 and multiplied into ``$0`` with activations ``$3 + 2s``, ``$4 + 2s``."""
    lines = [".reg .b32 t, p, c, u;", ".reg .f32 lo, hi;", "mov.b32 c, 0x43084308;"]
    for pair in range(4):
        source = "$1" if pair == 0 else "t"
        if pair:
            lines.append(f"shr.u32 t, $1, {4 * pair};")
        lines += [
            f"lop3.b32 p, {source}, 0x000F000F, 0x43004300, 0xEA;",
            "sub.rn.bf16x2 p, p, c;",
            "mul.rn.bf16x2 p, p, $2;",
            "shl.b32 u, p, 16;",
            "mov.b32 lo, u;",
            "and.b32 u, p, 0xFFFF0000;",
            "mov.b32 hi, u;",
            "mul.rn.f32 $0, lo, $3;" if pair == 0 else f"fma.rn.f32 $0, lo, ${3 + 2 * pair}, $0;",
            f"fma.rn.f32 $0, hi, ${4 + 2 * pair}, $0;",
        ]
    return "{\n" + "\n".join(lines) + "\n}"


_WORD_DOT_PTX = tl.constexpr(_word_dot_ptx())


@triton.jit
def _word_dot(word, scale2, x0, x1, x2, x3, x4, x5, x6, x7):
    """fp32 ``sum_j w_j * x_j`` over the 8 weights of a ``halves`` int32 word (bf16 ``w_j = q_j * s`` rounded once,
    as the QAT forward; exact bf16 x bf16 products, fp32 sums). Per pair: ``lop3`` (``128 + nibble``), ``sub.bf16x2``
    (``q``), ``mul.bf16x2`` (the scale), two unpacks to fp32 and two FMAs: ~4 instructions per weight."""
    return tl.inline_asm_elementwise(
        asm=_WORD_DOT_PTX, constraints="=f,r,r,f,f,f,f,f,f,f,f",
        args=[word, scale2, x0, x1, x2, x3, x4, x5, x6, x7], dtype=tl.float32, is_pure=True, pack=1,
    )


@triton.jit
def _word_dot_emulated(word, scale, x0, x1, x2, x3, x4, x5, x6, x7, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """:func:`_word_dot` in plain Triton (the interpreter; fp16 activations): same weights, same order."""
    total = _dequantize((word & 0xF).to(tl.int16), scale, DTYPE, EMULATE).to(tl.float32) * x0
    total += _dequantize(((word >> 16) & 0xF).to(tl.int16), scale, DTYPE, EMULATE).to(tl.float32) * x1
    total += _dequantize(((word >> 4) & 0xF).to(tl.int16), scale, DTYPE, EMULATE).to(tl.float32) * x2
    total += _dequantize(((word >> 20) & 0xF).to(tl.int16), scale, DTYPE, EMULATE).to(tl.float32) * x3
    total += _dequantize(((word >> 8) & 0xF).to(tl.int16), scale, DTYPE, EMULATE).to(tl.float32) * x4
    total += _dequantize(((word >> 24) & 0xF).to(tl.int16), scale, DTYPE, EMULATE).to(tl.float32) * x5
    total += _dequantize(((word >> 12) & 0xF).to(tl.int16), scale, DTYPE, EMULATE).to(tl.float32) * x6
    total += _dequantize(((word >> 28) & 0xF).to(tl.int16), scale, DTYPE, EMULATE).to(tl.float32) * x7
    return total


@triton.jit
def _scaled_word_dot(words, scale, x0, x1, x2, x3, x4, x5, x6, x7, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 ``[BLOCK_N, W]`` lanes: each word's eight weights (its row's bf16 ``scale [BLOCK_N]``) times the
    activations ``x0 .. x7 [1, W]`` of its inputs: :func:`_word_dot` on the GPU with bf16, else
    :func:`_word_dot_emulated` (same weights, same order)."""
    if EMULATE or DTYPE != tl.bfloat16:
        return _word_dot_emulated(words, scale, x0, x1, x2, x3, x4, x5, x6, x7, DTYPE, EMULATE)
    bits = scale.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    scale2 = tl.broadcast_to((bits | (bits << 16))[:, None], words.shape)
    return _word_dot(words, scale2, tl.broadcast_to(x0, words.shape), tl.broadcast_to(x1, words.shape),
                     tl.broadcast_to(x2, words.shape), tl.broadcast_to(x3, words.shape),
                     tl.broadcast_to(x4, words.shape), tl.broadcast_to(x5, words.shape),
                     tl.broadcast_to(x6, words.shape), tl.broadcast_to(x7, words.shape))


@triton.jit
def _x_of(x_ptr, base, offs_w, HALF: tl.constexpr, J: tl.constexpr):
    """fp32 activations ``[1, W]`` for input ``J`` of :func:`_word_dot` of every word of a group at ``base``."""
    HALF_J: tl.constexpr = (J // 2) % 2
    BYTE_J: tl.constexpr = 2 * (J % 2) + J // 4
    return tl.load(x_ptr + base + HALF_J * HALF + 4 * offs_w + BYTE_J).to(tl.float32)[None, :]


@triton.jit
def _gemv_weights(w_ptrs, s_ptrs, mask_n, group, stride_group, EVEN_N: tl.constexpr):
    """One group's int32 words ``[BLOCK_N, WORDS]`` and bf16 scales ``[BLOCK_N]``."""
    if EVEN_N:
        return tl.load(w_ptrs + group * stride_group), tl.load(s_ptrs + group)
    return (tl.load(w_ptrs + group * stride_group, mask=mask_n[:, None], other=0),
            tl.load(s_ptrs + group, mask=mask_n, other=0.0))


@triton.jit
def _int4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, sem_ptr, N, stride_tile, stride_row, stride_group, stride_sn,
    GROUPS_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, REDUCE_IN_KERNEL: tl.constexpr,
    EMULATE: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr,
    TILE: tl.constexpr,
):
    """``y [1, N] = x [1, K] @ w_dq^T`` on CUDA cores: ``w_ptr`` the ``halves`` bytes as int32 words, word ``w`` of
    group ``g`` of row ``r`` at :func:`_row_offsets` ``+ g stride_group + w`` (in words: rows or
    :func:`miles_int4.kernels.tile_halves` tiles); a program owns ``BLOCK_N`` rows and a run of groups; fp32 partial sums per
    (row, word) lane, reduced once at the end; split-K as :func:`_int4_small_m_kernel`."""
    WORDS: tl.constexpr = HALF // 4
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, WORDS)
    mask_n = offs_n < N
    w_ptrs = w_ptr + _row_offsets(offs_n, TILE, stride_tile, stride_row)[:, None] + offs_w[None, :]
    s_ptrs = s_ptr + offs_n.to(tl.int64) * stride_sn
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    first = pid_k * GROUPS_PER_SPLIT
    words, scale = _gemv_weights(w_ptrs, s_ptrs, mask_n, first, stride_group, EVEN_N)
    for step in range(GROUPS_PER_SPLIT):
        group = first + step
        # the next group's weights are requested before this group's arithmetic (a warp then waits on
        # HBM once per two groups' worth of work, not once per group: the GEMV is latency-bound otherwise)
        following = tl.minimum(group + 1, first + GROUPS_PER_SPLIT - 1)
        next_words, next_scale = _gemv_weights(w_ptrs, s_ptrs, mask_n, following, stride_group, EVEN_N)
        base = group * GROUP
        x0 = _x_of(x_ptr, base, offs_w, HALF, 0)
        x1 = _x_of(x_ptr, base, offs_w, HALF, 1)
        x2 = _x_of(x_ptr, base, offs_w, HALF, 2)
        x3 = _x_of(x_ptr, base, offs_w, HALF, 3)
        x4 = _x_of(x_ptr, base, offs_w, HALF, 4)
        x5 = _x_of(x_ptr, base, offs_w, HALF, 5)
        x6 = _x_of(x_ptr, base, offs_w, HALF, 6)
        x7 = _x_of(x_ptr, base, offs_w, HALF, 7)
        acc += _scaled_word_dot(words, scale, x0, x1, x2, x3, x4, x5, x6, x7, dtype, EMULATE)
        words, scale = next_words, next_scale
    total = tl.sum(acc, axis=1)[:, None]
    offs = offs_n[:, None]
    split_k_epilogue(total, y_ptr, part_ptr, sem_ptr, offs, offs, mask_n[:, None], pid_n, pid_k, N,
                     SPLIT_K, REDUCE_IN_KERNEL, EMULATE)


#: rows per GEMV program, and its warps (fixed by the shape: the same launch in every captured graph).
#: 128 x 4 warps: each thread owns 4 rows x 4 words, so the 32 activations it reads per group serve 128
#: weights (sm_90 SASS: ~4.8 instructions per weight in the loop, ~4 of them the dequantize-and-FMA);
#: 8 warps for K >= 8192 (the H200 sweep's best on the 8B down_proj, K = 12288)
GEMV_BLOCK_N = 128
GEMV_WARPS = 4


def gemv_config(k: int) -> tuple[int, int]:
    """(rows per program, warps) of the GEMV for ``k`` input columns."""
    return (GEMV_BLOCK_N, 8 if k >= 8192 else GEMV_WARPS)


def gemv_enabled() -> bool:
    """``--int4-gemv 0`` sends one-token inputs to the tensor-core kernel too (comparisons)."""
    return switches.value(kernel_switches.GEMV) == 1


def weight_addressing(packed: torch.Tensor, group_size: int, unit: torch.dtype, block_n: int) -> tuple:
    """``(tensor, N, TILE, stride_tile, stride_row, stride_group)`` of a ``halves`` weight for the kernels, in
    ``unit`` elements (uint8 bytes or int32 words): ``packed`` is uint8 rows ``[N, K/2]`` (TILE is then the
    program's ``block_n``: any divisor gives the same addresses) or :func:`miles_int4.kernels.tile_halves` tiles."""
    unit_bytes = torch.empty((), dtype=unit).element_size()
    if packed.dim() == 4:
        tiles, _, tile, _ = packed.shape
        tensor = packed.view(unit) if unit != packed.dtype else packed
        return tensor, tiles * tile, tile, tensor.stride(0), tensor.stride(2), tensor.stride(1)
    tensor = packed.contiguous().view(unit)
    return tensor, packed.shape[0], block_n, block_n * tensor.stride(0), tensor.stride(0), group_size // 2 // unit_bytes


def _int4_gemv(x, packed, scale, group_size, out, block_n: int | None = None, warps: int | None = None,
               split: int | None = None):
    """``packed``: ``halves`` bytes ``[N, K/2]`` or their tiles (:func:`miles_int4.kernels.tile_halves`)."""
    k = x.shape[1]
    default_block_n, default_warps = gemv_config(k)
    block_n, warps = block_n or default_block_n, warps or default_warps
    words, n, tile, *strides = weight_addressing(packed, group_size, torch.int32, block_n)
    n_tiles, groups = triton.cdiv(n, block_n), k // group_size
    if split is None:
        sms = split_k.num_sms(x.device.index or 0) if x.is_cuda else 132
        plan = split_k.plan_split_k(1, n_tiles, groups, k // 2 + 2 * groups, sms)
    else:
        plan = split_k.fixed_split(n_tiles, groups, split)
    partials, counters, in_kernel = split_k.workspace(plan, 1, n, x.device, out)
    _int4_gemv_kernel[(plan.n_tiles, plan.split_k)](
        x, words, scale, out, partials, counters, n, *strides, scale.stride(0),
        GROUPS_PER_SPLIT=plan.blocks_per_split, SPLIT_K=plan.split_k, REDUCE_IN_KERNEL=in_kernel,
        EMULATE=emulate_rounding(), EVEN_N=n % block_n == 0, BLOCK_N=block_n, GROUP=group_size,
        HALF=group_size // 2, TILE=tile, num_warps=warps,
    )
    if not in_kernel:
        out.copy_(partials.sum(dim=0))
    return out


def int4_small_m_mm(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int,
    out_dtype: torch.dtype | None = None, config: SmallMConfig | None = None, split: int | None = None,
) -> torch.Tensor:
    """``x [M, K] @ w_dq^T`` with ``w`` as ``halves`` bytes ``[N, K/2]`` (or their tiles,
    :func:`miles_int4.kernels.tile_halves`) and bf16 ``scale [N, K/gs]``; M <= 64.

    ``out_dtype`` defaults to ``x.dtype``; ``config`` and ``split`` override the
    fixed table (benchmarks). CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``.
    """
    m, k = x.shape
    tiled = packed.dim() == 4
    n = packed.shape[0] * packed.shape[2] if tiled else packed.shape[0]
    if m > MAX_M or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"int4 small-M GEMM takes <= {MAX_M} bf16/fp16 rows, got {tuple(x.shape)} {x.dtype}")
    fits = ((packed.dtype, packed.shape[1] * packed.shape[3] * 8) == (torch.int32, k) and packed.is_contiguous()
            if tiled else (packed.dtype, tuple(packed.shape)) == (torch.uint8, (n, k // 2)))
    if not fits or tuple(scale.shape) != (n, k // group_size):
        raise ValueError(f"int4 small-M GEMM: packed {tuple(packed.shape)} {packed.dtype} / scale {tuple(scale.shape)} "
                         f"do not fit x {tuple(x.shape)} with group size {group_size}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    packed = packed if packed.stride(-1) == 1 else packed.contiguous()
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if m == 1 and config is None and gemv_enabled():
        return _int4_gemv(x, packed, scale, group_size, out, split=split)
    cfg = config or small_m_config(m)
    assert cfg.block_m >= m, cfg
    n_tiles, groups = triton.cdiv(n, cfg.block_n), k // group_size
    if split is None:
        sms = split_k.num_sms(x.device.index or 0) if x.is_cuda else 132
        plan = split_k.plan_split_k(m, n_tiles, groups, k // 2 + 2 * groups, sms)
    else:
        plan = split_k.fixed_split(n_tiles, groups, split)
    partials, counters, in_kernel = split_k.workspace(plan, m, n, x.device, out)
    weight, _, tile, *strides = weight_addressing(packed, group_size, torch.uint8, cfg.block_n)
    _int4_small_m_kernel[(plan.n_tiles, plan.split_k)](
        x, weight, scale, out, partials, counters,
        m, n, x.stride(0), *strides, scale.stride(0), out.stride(0),
        GROUPS_PER_SPLIT=plan.blocks_per_split, SPLIT_K=plan.split_k, REDUCE_IN_KERNEL=in_kernel,
        EMULATE=emulate_rounding(), EVEN_N=n % cfg.block_n == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        GROUP=group_size, HALF=group_size // 2, TILE=tile, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not in_kernel:
        out.copy_(partials.sum(dim=0))
    return out
