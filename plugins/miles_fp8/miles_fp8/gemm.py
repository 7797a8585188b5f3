"""The block-scaled FP8 GEMM ``y = (a_q * a_scale) @ (b_q * b_scale)^T`` and its backends.

``a_q [M, K]`` is quantized in 1x128 groups (``a_scale [M, K/128]``); ``b_q [N, K]``
in 128x128 blocks (``b_scale [N/128, K/128]``, a weight) or in 1x128 groups
(``b_scale [N, K/128]``, the weight-gradient GEMM where both operands are
activations). Backends:

- ``reference``: dequantize both operands and multiply in float32 (CPU, and the
  ground truth of the GPU tests);
- ``scaled_mm``: cuBLAS block scaling through ``torch._scaled_mm`` / ``F.scaled_mm``
  (SM90, CUDA >= 12.9), used for 128x128-block operands only after it passed a
  numerical self-check on this GPU;
- ``triton``: :mod:`miles_fp8.triton_kernels`, for everything else on CUDA.

The switch ``--fp8-gemm reference|triton|scaled_mm|auto`` overrides the choice.

A linear's forward (:func:`quantized_linear_mm`) takes one more route: on CUDA,
with ``auto``, up to ``--fp8-small-m`` token rows (default 64, 0 turns it
off) run :mod:`miles_fp8.decode_gemm`, which quantizes the activations inside
the GEMM (one launch per linear at decode instead of two).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from miles_fp8 import kernel_switches
from miles_fp8.quant import BLOCK, dequantize, use_reference
from miles_host.kernels import switches

logger = logging.getLogger(__name__)

#: device index -> whether cuBLAS block-scaled _scaled_mm passed the self-check
_SCALED_MM_OK: dict[int, bool] = {}


def block_scaled_mm_ref(
    a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Reference: dequantize both operands, ``matmul`` in float32, cast to ``out_dtype``."""
    return (dequantize(a_q, a_scale) @ dequantize(b_q, b_scale).T).to(out_dtype)


def _check_operands(a_q, a_scale, b_q, b_scale) -> None:
    m, k = a_q.shape
    n, k_b = b_q.shape
    if k != k_b or k % BLOCK:
        raise ValueError(f"block_scaled_mm: a {tuple(a_q.shape)} and b {tuple(b_q.shape)} need one K divisible by {BLOCK}")
    if tuple(a_scale.shape) != (m, k // BLOCK):
        raise ValueError(f"block_scaled_mm: a_scale {tuple(a_scale.shape)} should be {(m, k // BLOCK)} (1x128 groups)")
    if tuple(b_scale.shape) not in ((n // BLOCK, k // BLOCK), (n, k // BLOCK)) or (
        tuple(b_scale.shape) == (n // BLOCK, k // BLOCK) and n % BLOCK
    ):
        raise ValueError(
            f"block_scaled_mm: b_scale {tuple(b_scale.shape)} should be {(n // BLOCK, k // BLOCK)} "
            f"(128x128 blocks) or {(n, k // BLOCK)} (1x128 groups)"
        )


def _scaled_mm_cublas(a_q, a_scale, b_q, b_scale, out_dtype) -> torch.Tensor:
    """cuBLAS 1x128 x 128x128 block scaling (the layout PyTorch's own tests use).

    cuBLAS wants the token count a multiple of 4 (callers elsewhere zero-pad it too):
    rows are padded with zeros (scale 1) and cut from the output.
    """
    rows = a_q.shape[0]
    pad_rows = -rows % 4
    if pad_rows:
        a_q = torch.cat([a_q, torch.zeros(pad_rows, a_q.shape[1], dtype=a_q.dtype, device=a_q.device)])
        a_scale = torch.cat([a_scale, torch.ones(pad_rows, a_scale.shape[1], dtype=a_scale.dtype, device=a_scale.device)])
    return _scaled_mm_cublas_rows4(a_q, a_scale, b_q, b_scale, out_dtype)[:rows]


def _scaled_mm_cublas_rows4(a_q, a_scale, b_q, b_scale, out_dtype) -> torch.Tensor:
    a_scale = a_scale.float().t().contiguous().t()  # 1x128 scales must be outer-dim-major
    b_q = b_q.contiguous()  # mat2 = b_q.t() must be column-major
    scaled_mm = getattr(F, "scaled_mm", None)
    if scaled_mm is not None and hasattr(F, "ScalingType"):
        pad = (-b_scale.shape[1]) % 4  # cuBLAS wants the K/128 dim of 128x128 scales padded to 4
        b_scale_l4 = F.pad(b_scale.float(), (0, pad)) if pad else b_scale.float().contiguous()
        return scaled_mm(
            a_q, b_q.t(), a_scale, F.ScalingType.BlockWise1x128, b_scale_l4.t(), F.ScalingType.BlockWise128x128,
            output_dtype=out_dtype,
        )
    return torch._scaled_mm(a_q, b_q.t(), scale_a=a_scale, scale_b=b_scale.float().t(), out_dtype=out_dtype)


def scaled_mm_usable(device: torch.device) -> bool:
    """Whether cuBLAS block scaling works here and agrees with the reference (checked once per GPU)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _SCALED_MM_OK:
        return _SCALED_MM_OK[index]
    from miles_fp8.quant import quantize_act_ref, quantize_weight_ref

    ok, why = True, ""
    generator = torch.Generator(device="cpu").manual_seed(0)
    try:
        for m, n, k in ((1, 256, 384), (100, 128, 256), (256, 384, 512)):
            a_q, a_s = quantize_act_ref(torch.randn(m, k, generator=generator))
            b_q, b_s = quantize_weight_ref(torch.randn(n, k, generator=generator))
            expected = block_scaled_mm_ref(a_q, a_s, b_q, b_s, torch.float32)
            got = _scaled_mm_cublas(
                a_q.to(device), a_s.to(device), b_q.to(device), b_s.to(device), torch.float32
            ).cpu()
            error = ((got - expected).norm() / expected.norm()).item()
            if not error < 1e-3:
                ok, why = False, f"relative error {error:.2e} at M,N,K={m},{n},{k}"
                break
    except Exception as exc:  # noqa: BLE001 - any failure means: use the Triton kernel
        ok, why = False, f"{type(exc).__name__}: {exc}".splitlines()[0]
    logger.info("fp8: cuBLAS block-scaled _scaled_mm %s%s", "in use" if ok else "not used, Triton GEMM instead", f" ({why})" if why else "")
    _SCALED_MM_OK[index] = ok
    return ok


def gemm_backend(a_q: torch.Tensor, b_scale: torch.Tensor, n: int) -> str:
    """Which backend :func:`block_scaled_mm` uses for these operands."""
    if not a_q.is_cuda or use_reference():
        return "reference"
    choice = switches.value(kernel_switches.GEMM)
    block_scaled_b = b_scale.shape[0] != n
    if choice == "auto":
        return "scaled_mm" if block_scaled_b and scaled_mm_usable(a_q.device) else "triton"
    if choice == "scaled_mm" and not block_scaled_b:
        return "triton"  # cuBLAS has no 1x128 x 1x128 path we use; the wgrad GEMM stays on Triton
    return choice


def small_m_limit() -> int:
    """Most token rows the fused small-M kernel takes (``--fp8-small-m``, default and cap 64)."""
    from miles_fp8.decode_gemm import MAX_M

    return max(0, min(switches.value(kernel_switches.SMALL_M), MAX_M))


def uses_small_m_kernel(x_MK: torch.Tensor, weight_scale: torch.Tensor, n: int) -> bool:
    """Whether :func:`quantized_linear_mm` runs the fused small-M kernel for these operands."""
    if not x_MK.is_cuda or use_reference() or switches.value(kernel_switches.GEMM) != "auto":
        return False
    return 0 < x_MK.shape[0] <= small_m_limit() and weight_scale.shape[0] * BLOCK == n


def quantized_linear_mm(
    x_MK: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor, power_of_two: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``Q_1x128(x) @ (weight_q * weight_scale)^T`` for a linear's forward (training and rollout alike).

    Small M on CUDA: the fused kernel (:mod:`miles_fp8.decode_gemm`); otherwise
    :func:`quantize_act` then :func:`block_scaled_mm`. Both compute the
    reference's numbers up to the order of the fp32 sums.
    """
    from miles_fp8.quant import quantize_act

    if uses_small_m_kernel(x_MK, weight_scale, weight_q.shape[0]):
        from miles_fp8 import decode_gemm

        return decode_gemm.fused_act_quant_mm(x_MK, weight_q, weight_scale, power_of_two, out_dtype)
    x_q, x_s = quantize_act(x_MK, power_of_two)
    return block_scaled_mm(x_q, x_s, weight_q, weight_scale, out_dtype=out_dtype)


def block_scaled_mm(
    a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``(a_q * a_scale) @ (b_q * b_scale)^T`` as ``[M, N]`` in ``out_dtype`` (see the module doc)."""
    _check_operands(a_q, a_scale, b_q, b_scale)
    backend = gemm_backend(a_q, b_scale, b_q.shape[0])
    if backend == "reference":
        return block_scaled_mm_ref(a_q, a_scale, b_q, b_scale, out_dtype)
    if backend == "scaled_mm":
        return _scaled_mm_cublas(a_q, a_scale, b_q, b_scale, out_dtype)
    from miles_fp8 import triton_kernels

    # FP8 wgmma wants both operands K-contiguous; the dgrad's transposed weight is not
    a_q = a_q if a_q.stride(1) == 1 else a_q.contiguous()
    b_q = b_q if b_q.stride(1) == 1 else b_q.contiguous()
    return triton_kernels.block_scaled_mm(a_q, a_scale, b_q, b_scale, out_dtype)
