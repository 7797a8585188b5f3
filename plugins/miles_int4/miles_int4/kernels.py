"""Weight-only INT4 GEMMs: torch's tinygemm int4 kernels on CPU and CUDA, and their reference.

torch's kernels store asymmetric groups, ``w = (u - 8) * scale + zero`` with
``u`` the unsigned nibble. Our symmetric ``q`` maps onto them exactly with
``u = q + 8`` and ``zero = 0``. Layouts (torch 2.13):

- CPU: ``_convert_weight_to_int4pack_for_cpu(u int32 [N, K], 1) -> uint8 [N, K/2]``,
  ``_weight_int4pack_mm_for_cpu(x [M, K], packed, group_size, sz [K/gs, N, 2])``;
  needs ``N % 16 == 0``; float32 or bf16 activations.
- CUDA (sm80+): ``_convert_weight_to_int4pack(u uint8 [N, K/2] (even column in the
  high nibble), inner_k_tiles) -> int32 tiles``, ``_weight_int4pack_mm(x bf16 [M, K],
  packed, group_size, sz bf16 [K/gs, N, 2])``; needs ``N % 8 == 0`` and
  ``K % (16 * inner_k_tiles) == 0``.

The kernels accumulate in their own order, so they match :func:`reference_mm`
(dequantize, then matmul) to rounding, not bit for bit; the bit-exact rollout
path is the dequantize path (``--int4-rollout-gemm dequant``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miles_int4.quant import QMIN, dequantize


@dataclass
class PackedInt4:
    """One weight in a kernel's layout: ``weight``, ``scales_and_zeros``, and the kernel's parameters."""

    weight: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int
    out_features: int
    device_type: str


def kernel_supports(out_features: int, in_features: int, device: torch.device) -> bool:
    """Whether torch's int4 kernel of ``device`` takes an ``[N, K]`` weight."""
    if device.type == "cpu":
        return out_features % 16 == 0 and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    if device.type == "cuda":
        return out_features % 8 == 0 and _inner_k_tiles(in_features) is not None and torch.cuda.get_device_capability(
            device
        ) >= (8, 0)
    return False


def _inner_k_tiles(in_features: int) -> int | None:
    for tiles in (8, 4, 2):
        if in_features % (16 * tiles) == 0:
            return tiles
    return None


def _scales_and_zeros(scale_NG: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    scale_GN = scale_NG.t().to(dtype)
    return torch.stack([scale_GN, torch.zeros_like(scale_GN)], dim=-1).contiguous()


def pack_for_kernel(q_NK: torch.Tensor, scale_NG: torch.Tensor, act_dtype: torch.dtype) -> PackedInt4:
    """``(q int8 [N, K], scale [N, G])`` -> the layout of torch's int4 kernel on ``q``'s device."""
    out_features, in_features = q_NK.shape
    group_size = in_features // scale_NG.shape[-1]
    unsigned = q_NK.to(torch.int32) - QMIN
    if q_NK.device.type == "cpu":
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned.contiguous(), 1)
        return PackedInt4(weight, _scales_and_zeros(scale_NG, act_dtype), group_size, out_features, "cpu")
    tiles = _inner_k_tiles(in_features)
    assert tiles is not None, f"K={in_features} has no inner_k_tiles"
    pairs = ((unsigned[:, ::2] << 4) | unsigned[:, 1::2]).to(torch.uint8).contiguous()
    weight = torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
    return PackedInt4(weight, _scales_and_zeros(scale_NG, torch.bfloat16), group_size, out_features, "cuda")


def int4_mm(x_MK: torch.Tensor, packed: PackedInt4) -> torch.Tensor:
    """``x [..., K] @ w.T`` with ``w`` in torch's int4 layout; output in ``x``'s dtype."""
    x_2d = x_MK.reshape(-1, x_MK.shape[-1])
    if packed.device_type == "cpu":
        sz = packed.scales_and_zeros
        if sz.dtype != x_2d.dtype:
            sz = sz.to(x_2d.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x_2d.contiguous(), packed.weight, packed.group_size, sz)
    else:
        y = torch.ops.aten._weight_int4pack_mm(
            x_2d.to(torch.bfloat16).contiguous(), packed.weight, packed.group_size, packed.scales_and_zeros
        ).to(x_2d.dtype)
    return y.reshape(*x_MK.shape[:-1], packed.out_features)


def reference_mm(x_MK: torch.Tensor, q_NK: torch.Tensor, scale_NG: torch.Tensor) -> torch.Tensor:
    """The float reference of :func:`int4_mm`: dequantize in ``x``'s dtype, then ``F.linear``."""
    return F.linear(x_MK, dequantize(q_NK, scale_NG, x_MK.dtype))
