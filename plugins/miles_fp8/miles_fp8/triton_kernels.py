"""Triton kernels for the GPU: 1x128 / 128x128 FP8 quantization and the block-scaled GEMM.

Imported lazily (only when a CUDA tensor is quantized or multiplied). The
quantize kernels are bitwise equal to :mod:`miles_fp8.quant`'s reference: the
amax is exact, both divisions are IEEE round-to-nearest (torch's ``/``; the 1x128
activation quantizer gets the quotient from a reciprocal and one FMA correction, see
:func:`_quantize_rows`, which keeps it memory-bound), the power-of-two rounding is the same bit arithmetic, and the FP8 cast
rounds to nearest even in both. Tensor legend: M rows, K reduction, N columns.
"""

from __future__ import annotations

import torch

from miles_fp8.quant import AMAX_EPS, BLOCK, FP8_DTYPE, FP8_MAX, check_block_divisible

try:
    import triton
    import triton.language as tl
except ImportError as error:  # pragma: no cover - only on a GPU machine without triton
    raise ValueError(
        "miles-fp8 needs triton for its GPU kernels (pip install triton); "
        "run with --fp8-reference 1 to use the slow plain-PyTorch path instead"
    ) from error


from miles_host.kernels.triton_common import emulate_rounding  # noqa: E402 - needs triton, checked above
from miles_host.kernels.triton_common import grouped_tile  # noqa: E402 - needs triton, checked above

AMAX_EPS_C = tl.constexpr(AMAX_EPS)
#: activation rows one quantize program takes (one 1x128 group column of each): 8 KB of bf16
#: per program instead of 256 bytes, so a training-sized activation is a few thousand programs
ACT_ROWS_PER_PROGRAM = 32
FP8_MAX_C = tl.constexpr(FP8_MAX)
#: smallest normal E4M3 magnitude (2^-6); below it the grid step is 2^-9
_E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)


@triton.jit
def _round_up_pow2(scale):
    bits = scale.to(tl.int32, bitcast=True)
    exponent = bits & 0x7F800000
    exponent = tl.where((bits & 0x007FFFFF) != 0, exponent + 0x00800000, exponent)
    return exponent.to(tl.float32, bitcast=True)


@triton.jit
def _round_to_e4m3(q):
    """Nearest-even E4M3 value of float32 ``q`` (|q| <= 448), as float32, by exact arithmetic.

    Normal range: keep 3 mantissa bits (integer round-half-even on the bits);
    subnormal range (|q| < 2^-6): the nearest multiple of 2^-9. Integer-exact,
    so the interpreter and the GPU give torch's ``.to(float8_e4m3fn)`` bit for bit.
    """
    bits = q.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    magnitude = tl.abs(q)
    steps = magnitude * 512.0  # exact: a power of two
    whole = steps.to(tl.int32)  # truncation = floor (non-negative)
    frac = steps - whole.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
    subnormal = (whole + up.to(tl.int32)).to(tl.float32) * 0.001953125
    subnormal = tl.where(q < 0, -subnormal, subnormal)
    return tl.where(magnitude < _E4M3_MIN_NORMAL, subnormal, normal)


@triton.jit
def _quantize_rows(x, POW2: tl.constexpr, EMULATE: tl.constexpr):
    """1x128 quantization of float32 ``x [R, 128]``: (values on the E4M3 grid as float16, scales [R]).

    Bit for bit the reference: ``x / scale`` correctly rounded (torch's ``/``), then
    the nearest-even E4M3 value, saturated at +-448 (the reference's clamp). On the
    GPU the quotient comes from the correctly rounded reciprocal ``r`` of the row's
    scale and one Markstein correction, ``q0 = x * r``, ``q = q0 + (x - q0 * scale) * r``
    (two FMAs; the correctly rounded quotient, as ``div.rn`` computes it, for the normal
    range: scales are >= 1e-12 / 448, and a subnormal ``x`` gives q ~ 0 either way),
    and the rounding is ``cvt.rn.satfinite`` (one instruction per two values). Under
    the interpreter both steps are done the literal way. Every E4M3 value is a float16.
    """
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, AMAX_EPS_C), FP8_MAX_C)
    if POW2:
        scale = _round_up_pow2(scale)
    scale_2d = tl.broadcast_to(scale[:, None], x.shape)
    if EMULATE:
        q = tl.math.div_rn(x, scale_2d)
        q = _round_to_e4m3(tl.minimum(tl.maximum(q, -FP8_MAX_C), FP8_MAX_C)).to(tl.float16)
    else:
        reciprocal = tl.broadcast_to(tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None], x.shape)
        q = x * reciprocal
        q = tl.fma(tl.fma(-q, scale_2d, x), reciprocal, q)
        q = q.to(tl.float8e4nv).to(tl.float16)  # cvt.rn.satfinite: +-448 beyond the range, as the clamp
    return q, scale


@triton.jit
def _quantize_tile(x, POW2: tl.constexpr):
    """(q float32 already clamped, scale) of one block of float32 values."""
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    scale = tl.math.div_rn(tl.maximum(amax, AMAX_EPS_C), FP8_MAX_C)
    if POW2:
        scale = _round_up_pow2(scale)
    q = tl.math.div_rn(x, tl.zeros_like(x) + scale)
    q = tl.minimum(tl.maximum(q, -FP8_MAX_C), FP8_MAX_C)
    return q, scale


@triton.jit
def _quantize_act_kernel(
    x_ptr, q_ptr, s_ptr, rows, stride_xm, stride_qm, stride_sm,
    POW2: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr, EMULATE: tl.constexpr,
):
    """``BLOCK_R`` rows of one 1x128 group column per program (one group per row: its own amax and scale)."""
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = row < rows
    x = tl.load(x_ptr + row[:, None] * stride_xm + cols[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
    q, scale = _quantize_rows(x, POW2, EMULATE)
    tl.store(q_ptr + row[:, None] * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask[:, None])
    tl.store(s_ptr + row * stride_sm + group, scale, mask=mask)


@triton.jit
def _quantize_weight_kernel(
    w_ptr, q_ptr, s_ptr, stride_wr, stride_qr, stride_sr, POW2: tl.constexpr, BLOCK_C: tl.constexpr
):
    row_block = tl.program_id(0).to(tl.int64)
    col_block = tl.program_id(1)
    rows = row_block * BLOCK_C + tl.arange(0, BLOCK_C)
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    w = tl.load(w_ptr + rows[:, None] * stride_wr + cols[None, :]).to(tl.float32)
    q, scale = _quantize_tile(w, POW2)
    tl.store(q_ptr + rows[:, None] * stride_qr + cols[None, :], q.to(q_ptr.dtype.element_ty))
    tl.store(s_ptr + row_block * stride_sr + col_block, scale)


def quantize_act(x: torch.Tensor, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 groups of ``x [..., K]`` -> ``(q fp8 [..., K], scale fp32 [..., K/128])``."""
    check_block_divisible(x.shape, "activation", dims=(-1,))
    lead, cols = x.shape[:-1], x.shape[-1]
    x_2d = x.reshape(-1, cols)
    if x_2d.stride(-1) != 1:
        x_2d = x_2d.contiguous()
    rows = x_2d.shape[0]
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, cols // BLOCK), dtype=torch.float32, device=x.device)
    if rows:
        block_r = ACT_ROWS_PER_PROGRAM if rows >= ACT_ROWS_PER_PROGRAM else triton.next_power_of_2(rows)
        _quantize_act_kernel[(triton.cdiv(rows, block_r), cols // BLOCK)](
            x_2d, q, scale, rows, x_2d.stride(0), q.stride(0), scale.stride(0), POW2=power_of_two, GROUP=BLOCK,
            BLOCK_R=block_r, EMULATE=emulate_rounding(), num_warps=4,
        )
    return q.reshape(*lead, cols), scale.reshape(*lead, cols // BLOCK)


def quantize_weight(w: torch.Tensor, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks of ``w [..., N, K]`` (per expert for a leading dim) -> ``(q, scale [..., N/128, K/128])``."""
    check_block_divisible(w.shape, "weight")
    *lead, rows, cols = w.shape
    w_2d = w.reshape(-1, cols)  # experts stack along rows; N % 128 == 0 keeps blocks inside one expert
    if w_2d.stride(-1) != 1:
        w_2d = w_2d.contiguous()
    q = torch.empty(w_2d.shape, dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty((w_2d.shape[0] // BLOCK, cols // BLOCK), dtype=torch.float32, device=w.device)
    if w_2d.shape[0]:
        _quantize_weight_kernel[(w_2d.shape[0] // BLOCK, cols // BLOCK)](
            w_2d, q, scale, w_2d.stride(0), q.stride(0), scale.stride(0), POW2=power_of_two, BLOCK_C=BLOCK,
            num_warps=8,
        )
    return q.reshape(*lead, rows, cols), scale.reshape(*lead, rows // BLOCK, cols // BLOCK)


@triton.jit
def _block_scaled_mm_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K_BLOCKS,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bsn, stride_bsk,
    B_SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """``c[M, N] = sum_kb (a[:, kb] @ b[:, kb]^T) * a_scale[:, kb] * b_scale[n // B_SCALE_ROWS, kb]``."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn
    as_ptrs = as_ptr + offs_m.to(tl.int64) * stride_asm
    bs_ptrs = bs_ptr + (offs_n // B_SCALE_ROWS).to(tl.int64) * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K_BLOCKS):
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        a_scale = tl.load(as_ptrs + kb * stride_ask, mask=mask_m, other=0.0)
        b_scale = tl.load(bs_ptrs + kb * stride_bsk, mask=mask_n, other=0.0)
        # promote each 128-deep partial product to fp32 with its scales (DeepSeek-V3's recipe)
        acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _config(m: int) -> dict:
    """A fixed tile choice per M range (no autotuning: the same shapes always run the same code)."""
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=BLOCK, GROUP_M=1, num_warps=4, num_stages=4)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=BLOCK, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=BLOCK, GROUP_M=8, num_warps=8, num_stages=3)


def block_scaled_mm(
    a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
    out_dtype: torch.dtype, config: dict | None = None,
) -> torch.Tensor:
    """Triton ``(a_q * a_scale) @ (b_q * b_scale)^T`` with ``b_scale`` per 128x128 block or per 1x128 group."""
    m, k = a_q.shape
    n = b_q.shape[0]
    b_scale_rows = 1 if b_scale.shape[0] == n else BLOCK
    out = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    if m == 0 or n == 0:
        return out
    cfg = dict(config or _config(m))
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _block_scaled_mm_kernel[grid](
        a_q, b_q, out, a_scale, b_scale, m, n, k // BLOCK,
        a_q.stride(0), a_q.stride(1), b_q.stride(0), b_q.stride(1), out.stride(0), out.stride(1),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
        B_SCALE_ROWS=b_scale_rows, **cfg,
    )
    return out
