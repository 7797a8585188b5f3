"""Decode-shape FP8 linear in one kernel: 1x128 activation quantization fused into the block-scaled GEMM.

``y = dequant(Q_1x128(x)) @ dequant(w_q, w_scale)^T`` for ``x [M, K]`` with M <= 64
(decode steps), ``w_q`` float8_e4m3fn ``[N, K]``, ``w_scale`` float32 ``[N/128, K/128]``:
the same numbers as :func:`miles_fp8.quant.quantize_act_ref` followed by
:func:`miles_fp8.gemm.block_scaled_mm_ref`, up to the order of the fp32 sums.

Design (the weight is streamed once from HBM; everything else is small):

- grid ``(N / BLOCK_N, SPLIT_K)``: a program owns ``BLOCK_N`` weight rows and a
  run of 128-wide K-blocks; SPLIT_K comes from :func:`miles_host.kernels.split_k.plan_split_k`
  so that an H200's 132 SMs get about two programs each, and the partial tiles
  are reduced by the last program of each tile (deterministic split order);
- per K-block: load the ``[BLOCK_N, 128]`` FP8 weight tile (128 contiguous bytes
  per row; Triton pipelines it through shared memory with ``num_stages``), load the
  ``[BLOCK_M, 128]`` activation tile and quantize it on the spot (:func:`_quantize_rows`:
  amax per row, ``scale = max(amax, eps) / 448`` with IEEE division, the power-of-two
  option, ``x / scale`` correctly rounded, saturated to +-448 and rounded to the
  nearest E4M3 value: the reference's numbers exactly); on GPUs with FP8 tensor cores
  (compute capability >= 8.9) the two FP8 tiles go straight into an FP8 ``dot`` (Hopper
  sums one 128-deep block at reduced precision inside the MMA, as DeepGEMM and cuBLAS
  do: relative error ~1e-4 against the fp32 sums, far below the FP8 rounding itself;
  faster than the fp16 route on the H200: ``bench/history/2026-12-01-2.md``);
  ``--fp8-small-m-mma 0`` (and the interpreter) converts both to float16 (every
  E4M3 value is exact there) for a dot with fp32 accumulation, the reference's sums;
  then ``acc += dot * w_scale[n] * x_scale[m]`` (each 128-deep block promoted to fp32
  with its two scales, as the reference's dequantized product sums them);
- the weight is the MMA's M side (``dot(w [BLOCK_N, 128], x^T [128, BLOCK_M])``)
  so M = 1..16 tokens pad only to 16;
- no autotuning: :func:`small_m_config` is a fixed table by M, so a CUDA graph
  captures the same launch every time.

Tensor legend: M tokens, N out features, K in features.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from miles_fp8 import kernel_switches
from miles_host.kernels import split_k, switches
from miles_host.kernels.split_k import SmallMConfig
from miles_host.kernels.triton_common import emulate_rounding, split_k_epilogue
from miles_fp8.quant import BLOCK, FP8_DTYPE
from miles_fp8.triton_kernels import _quantize_rows

#: largest token count the fused kernel takes; more tokens use quantize + block_scaled_mm
MAX_M = 64


def small_m_config(m: int, fp8_mma: bool = False) -> SmallMConfig:
    """The fixed tile table. 128 weight rows per program and 8 warps at every M: the
    in-kernel quantization of the ``[BLOCK_M, 128]`` activation tile is shared by more
    weight rows (about 260 instructions per thread and K-block at M <= 16, 390 at 32,
    650 at 64, on sm_90: below the SMs' issue rate for HBM speed up to M = 32). The
    H200 sweep (``bench/fp8_gemm.py --model 8b --sweep``) found no tile more than 1% faster
    with FP8 products (the default) at M = 1 on Qwen3-8B's linears."""
    return SmallMConfig(block_m=split_k.block_m_for(m), block_n=128, num_warps=8, num_stages=3, fp8_mma=fp8_mma)


def use_fp8_mma(device: torch.device) -> bool:
    """Whether the launch multiplies on FP8 tensor cores (see the module doc; ``--fp8-small-m-mma``)."""
    if switches.value(kernel_switches.SMALL_M_MMA) == 0 or device.type != "cuda" or emulate_rounding():
        return False
    return _has_fp8_mma(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _has_fp8_mma(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, stride_xm, K_BLOCKS, POW2: tl.constexpr, EMULATE: tl.constexpr):
    """The GEMM's in-kernel quantization alone (for tests): one 1x128 group per program."""
    row = tl.program_id(0).to(tl.int64)
    kb = tl.program_id(1)
    cols = kb * 128 + tl.arange(0, 128)
    x = tl.load(x_ptr + row * stride_xm + cols[None, :]).to(tl.float32)
    q, scale = _quantize_rows(x, POW2, EMULATE)
    tl.store(q_ptr + row * K_BLOCKS * 128 + cols[None, :], q.to(tl.float32))
    tl.store(s_ptr + row * K_BLOCKS + kb + tl.arange(0, 1), scale)


@triton.jit
def _fp8_small_m_kernel(
    x_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, sem_ptr,
    M, N, stride_xm, stride_wn, stride_wsn, stride_ym,
    BLOCKS_PER_SPLIT: tl.constexpr, POW2: tl.constexpr, SPLIT_K: tl.constexpr, REDUCE_IN_KERNEL: tl.constexpr,
    EMULATE: tl.constexpr, FP8_MMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, GROUP)
    mask_m = offs_m < M
    # N is a multiple of 128 and BLOCK_N divides 128: weight rows need no mask
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    ws_ptrs = ws_ptr + (offs_n // GROUP).to(tl.int64) * stride_wsn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(BLOCKS_PER_SPLIT):
        kb = pid_k * BLOCKS_PER_SPLIT + step
        w = tl.load(w_ptrs + kb * GROUP)
        x = tl.load(x_ptrs + kb * GROUP, mask=mask_m[:, None], other=0.0).to(tl.float32)
        q, x_scale = _quantize_rows(x, POW2, EMULATE)
        w_scale = tl.load(ws_ptrs + kb)
        if FP8_MMA:
            block = tl.dot(w, tl.trans(q.to(tl.float8e4nv)))
        else:
            block = tl.dot(w.to(tl.float16), tl.trans(q))
        acc += block * w_scale[:, None] * x_scale[None, :]
    y_offs = offs_m[None, :] * stride_ym + offs_n[:, None]
    part_offs = offs_m[None, :] * N + offs_n[:, None]
    split_k_epilogue(acc, y_ptr, part_ptr, sem_ptr, y_offs, part_offs, mask_m[None, :], pid_n, pid_k, M * N,
                     SPLIT_K, REDUCE_IN_KERNEL, EMULATE)


def _check(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> None:
    m, k = x.shape
    n = w_q.shape[0]
    if m > MAX_M:
        raise ValueError(f"fp8 small-M GEMM: {m} rows > {MAX_M}; use quantize_act + block_scaled_mm")
    if w_q.dtype != FP8_DTYPE or w_q.shape[1] != k or k % BLOCK or n % BLOCK:
        raise ValueError(f"fp8 small-M GEMM: weight {tuple(w_q.shape)} {w_q.dtype} for x {tuple(x.shape)}: "
                         f"needs float8_e4m3fn [N, K] with N, K multiples of {BLOCK}")
    if tuple(w_scale.shape) != (n // BLOCK, k // BLOCK):
        raise ValueError(f"fp8 small-M GEMM: w_scale {tuple(w_scale.shape)} should be {(n // BLOCK, k // BLOCK)}")


def fused_act_quant_mm(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, power_of_two: bool = False,
    out_dtype: torch.dtype | None = None, config: SmallMConfig | None = None, split: int | None = None,
) -> torch.Tensor:
    """``Q_1x128(x) @ (w_q * w_scale)^T`` for ``x [M, K]``, M <= 64, in one Triton launch (see the module doc).

    ``out_dtype`` defaults to ``x.dtype``; ``config`` and ``split`` override the
    fixed table (benchmarks). CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``.
    """
    _check(x, w_q, w_scale)
    if x.stride(-1) != 1:
        x = x.contiguous()
    w_q = w_q if w_q.stride(-1) == 1 else w_q.contiguous()
    m, k = x.shape
    n = w_q.shape[0]
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or small_m_config(m, use_fp8_mma(x.device))
    assert BLOCK % cfg.block_n == 0 and cfg.block_m >= m, cfg
    n_tiles, k_blocks = n // cfg.block_n, k // BLOCK
    if split is None:
        sms = split_k.num_sms(x.device.index or 0) if x.is_cuda else 132
        plan = split_k.plan_split_k(m, n_tiles, k_blocks, k, sms)
    else:
        plan = split_k.fixed_split(n_tiles, k_blocks, split)
    partials, counters, in_kernel = split_k.workspace(plan, m, n, x.device, out)
    _fp8_small_m_kernel[(plan.n_tiles, plan.split_k)](
        x, w_q, w_scale, out, partials, counters,
        m, n, x.stride(0), w_q.stride(0), w_scale.stride(0), out.stride(0),
        BLOCKS_PER_SPLIT=plan.blocks_per_split, POW2=power_of_two, SPLIT_K=plan.split_k, REDUCE_IN_KERNEL=in_kernel,
        EMULATE=emulate_rounding(), FP8_MMA=cfg.fp8_mma, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP=BLOCK,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not in_kernel:
        out.copy_(partials.sum(dim=0))
    return out


def quantize_rows(x: torch.Tensor, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The in-GEMM activation quantization alone: ``(q as float32 on the E4M3 grid, scale [M, K/128])``."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float32, device=x.device)
    scale = torch.empty((m, k // BLOCK), dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m, k // BLOCK)](x, q, scale, x.stride(0), k // BLOCK, POW2=power_of_two,
                                               EMULATE=emulate_rounding(), num_warps=1)
    return q, scale
