"""Block-scaled FP8 E4M3 quantization: the plain-PyTorch reference and the dispatch.

Two granularities, as DeepSeek-V3, SGLang and vLLM use them:

- activations in 1x128 groups: ``x [M, K]`` -> ``q [M, K]`` + ``scale [M, K/128]``
  (one scale per token and 128 input channels);
- weights in 128x128 blocks: ``w [..., N, K]`` -> ``q [..., N, K]`` + ``scale [..., N/128, K/128]``
  (a leading expert dim ``E`` is quantized per expert).

Scales are float32 *dequantization* multipliers, ``amax / 448`` (optionally rounded
up to a power of two), so ``x ~= q * scale``; this is what checkpoints call
``weight_scale_inv``. Tensor legend: M rows (tokens), K input channels (the
reduction dim), N output channels, E experts.

The reference runs anywhere (``torch.float8_e4m3fn`` exists on CPU); on CUDA the
Triton kernels in :mod:`miles_fp8.triton_kernels` compute bitwise the same result.
"""

from __future__ import annotations

import torch

from miles_fp8 import kernel_switches
from miles_host.kernels import switches

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
#: an all-zero group gets scale ``AMAX_EPS / 448`` (q = 0) instead of a division by zero
AMAX_EPS = 1e-12

_EXPONENT_BITS = 0x7F800000
_MANTISSA_BITS = 0x007FFFFF
_EXPONENT_ONE = 0x00800000


def check_block_divisible(shape, name: str = "tensor", dims: tuple[int, ...] = (-2, -1)) -> None:
    """ValueError unless the listed dims of ``shape`` are multiples of 128, naming the layer."""
    bad = [tuple(shape)[d] for d in dims if tuple(shape)[d] % BLOCK]
    if bad:
        raise ValueError(
            f"FP8 block scaling needs dims divisible by {BLOCK}: {name!r} has shape {tuple(shape)} "
            f"(dims {bad} are not multiples of {BLOCK}). Keep this layer in bf16 (the fp8 precision "
            f"recipe does that by itself for model layers) or pad the layer to a multiple of {BLOCK}."
        )


def round_scale_up_to_power_of_two(scale: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= ``scale`` (float32, positive, normal), by exact bit arithmetic."""
    bits = scale.float().contiguous().view(torch.int32)
    exponent = bits & _EXPONENT_BITS
    rounded = torch.where((bits & _MANTISSA_BITS) != 0, exponent + _EXPONENT_ONE, exponent)
    return rounded.view(torch.float32)


def scale_from_amax(amax: torch.Tensor, power_of_two: bool = False) -> torch.Tensor:
    """Float32 dequantization scale ``max(amax, eps) / 448`` (rounded up to 2^k if asked)."""
    scale = amax.float().clamp(min=AMAX_EPS) / FP8_MAX
    return round_scale_up_to_power_of_two(scale) if power_of_two else scale


def _to_fp8(scaled: torch.Tensor) -> torch.Tensor:
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_act_ref(x: torch.Tensor, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference 1x128 quantization of ``x [..., K]``: ``(q [..., K] fp8, scale [..., K/128] fp32)``."""
    check_block_divisible(x.shape, "activation", dims=(-1,))
    groups = x.float().unflatten(-1, (-1, BLOCK))
    scale = scale_from_amax(groups.abs().amax(dim=-1), power_of_two)
    return _to_fp8(groups / scale[..., None]).flatten(-2), scale


def quantize_weight_ref(w: torch.Tensor, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference 128x128 quantization of ``w [..., N, K]``: ``(q fp8, scale [..., N/128, K/128] fp32)``."""
    check_block_divisible(w.shape, "weight")
    *lead, rows, cols = w.shape
    blocks = w.float().reshape(*lead, rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scale = scale_from_amax(blocks.abs().amax(dim=(-3, -1)), power_of_two)
    q = _to_fp8(blocks / scale[..., :, None, :, None])
    return q.reshape(*lead, rows, cols), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` broadcast over its blocks; the block shape follows from the shapes.

    ``scale [..., R/br, C/128]`` for ``q [..., R, C]``: ``br`` is 1 for activation
    groups (``scale`` has one row per row of ``q``) and 128 for weight blocks.
    """
    *lead, rows, cols = q.shape
    block_rows = rows // scale.shape[-2]
    block_cols = cols // scale.shape[-1]
    assert block_rows * scale.shape[-2] == rows and block_cols * scale.shape[-1] == cols, (q.shape, scale.shape)
    x = q.float().reshape(*lead, rows // block_rows, block_rows, cols // block_cols, block_cols)
    x = x * scale.float()[..., :, None, :, None]
    return x.reshape(*lead, rows, cols).to(dtype)


def use_reference() -> bool:
    """``--fp8-reference 1`` forces the plain-PyTorch path on the GPU (debugging)."""
    return switches.value(kernel_switches.REFERENCE) == 1


def quantize_act(x: torch.Tensor, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 quantization of ``x [..., K]``: Triton on CUDA, the reference elsewhere."""
    if x.is_cuda and not use_reference():
        from miles_fp8 import triton_kernels

        return triton_kernels.quantize_act(x, power_of_two)
    return quantize_act_ref(x, power_of_two)


def quantize_weight(w: torch.Tensor, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 quantization of ``w [..., N, K]``: Triton on CUDA, the reference elsewhere."""
    if w.is_cuda and not use_reference():
        from miles_fp8 import triton_kernels

        return triton_kernels.quantize_weight(w, power_of_two)
    return quantize_weight_ref(w, power_of_two)
