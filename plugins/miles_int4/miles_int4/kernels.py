"""Weight-only INT4 GEMMs and the weight layouts they read.

Three layouts of the same ``(q int8 [N, K], scale bf16 [N, K/gs])`` (:mod:`miles_int4.quant`):

- ``halves`` (CUDA, the rollout's layout): uint8 ``[N, K/2]``; within each group
  of ``gs`` input columns, byte ``j`` holds column ``j`` in its low nibble and
  column ``j + gs/2`` in its high nibble, both as ``q + 8``; ``scales`` is the
  bf16 ``[N, K/gs]`` scale itself. Read by :mod:`miles_int4.decode_gemm` (a Triton
  kernel for up to ``--int4-small-m`` = 64 token rows: decode) and, for more
  rows (prefill), dequantized with the QAT formula then multiplied by ``F.linear``.
  Same bytes as the compressed-tensors form: 0.5 byte per weight + the scales.
  Stored tile by tile when N is a multiple of :data:`HALVES_TILE_ROWS` (:func:`tile_halves`:
  int32 words ``[N/T, K/gs, T, gs/8]``, so the T rows' bytes of one group, what one
  decode program reads per step, are one contiguous run; ``--int4-tile-rows 0``
  keeps ``[N, K/2]`` rows, for comparisons).
- ``cpu``: torch's CPU kernel, ``_convert_weight_to_int4pack_for_cpu(u int32 [N, K], 1)
  -> uint8 [N, K/2]`` and ``_weight_int4pack_mm_for_cpu(x, packed, gs, sz [K/gs, N, 2])``
  (needs ``N % 16 == 0``).
- ``tinygemm`` (CUDA, kept for comparison): torch's ``_weight_int4pack_mm`` on
  ``_convert_weight_to_int4pack(uint8 [N, K/2], inner_k_tiles)`` tiles
  (needs ``N % 8 == 0``, ``K % (16 * inner_k_tiles) == 0``, sm80+).

torch's kernels store asymmetric groups, ``w = (u - 8) * scale + zero``; our
symmetric ``q`` maps onto them exactly with ``u = q + 8`` and ``zero = 0``.
The kernels add up products in their own order, so they match :func:`reference_mm`
(dequantize, then matmul) to rounding, not bit for bit; the bit-exact rollout path
is the dequantize path (``--int4-rollout-gemm dequant``). The ``halves`` kernel
dequantizes each weight exactly as the QAT forward does (``bf16(fp32(q) * fp32(scale))``)
and sums in fp32, so it differs from :func:`reference_mm` only in the order of the sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miles_host.kernels import switches
from miles_int4 import kernel_switches
from miles_int4.quant import QMIN, dequantize

LAYOUTS = ("halves", "cpu", "tinygemm")
#: rows of one tile of the ``halves`` layout (the GEMV's rows per program; two tensor-core programs)
HALVES_TILE_ROWS = 128
#: most token rows of the Triton small-M kernel (``--int4-small-m`` may lower it; 0 turns it off)
SMALL_M_MAX = 64


@dataclass
class PackedInt4:
    """One weight in a kernel's layout (see the module doc): ``weight``, ``scales`` and the layout's parameters.

    ``scales``: the bf16 group scales ``[N, K/gs]`` (``halves``) or torch's
    ``scales_and_zeros [K/gs, N, 2]`` (``cpu``, ``tinygemm``).
    """

    weight: torch.Tensor
    scales: torch.Tensor
    group_size: int
    out_features: int
    layout: str
    #: ``halves`` only: rows per tile of :func:`tile_halves` (``weight`` is then int32 ``[N/T, K/gs, T, gs/8]``), 0: rows
    tile_rows: int = 0


def default_layout(device: torch.device) -> str:
    """``cpu`` on CPU; on CUDA ``halves``, or ``tinygemm`` under ``--int4-cuda-layout tinygemm`` (comparisons)."""
    if device.type == "cpu":
        return "cpu"
    return switches.value(kernel_switches.CUDA_LAYOUT)


def kernel_supports(out_features: int, in_features: int, device: torch.device, layout: str | None = None) -> bool:
    """Whether ``layout`` (default: the device's) takes an ``[N, K]`` weight on ``device``."""
    layout = layout or default_layout(device)
    if layout == "cpu":
        return device.type == "cpu" and out_features % 16 == 0 and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        return False
    if layout == "tinygemm":
        return out_features % 8 == 0 and _inner_k_tiles(in_features) is not None
    from miles_host.kernels import triton_importable

    return triton_importable()


def _inner_k_tiles(in_features: int) -> int | None:
    for tiles in (8, 4, 2):
        if in_features % (16 * tiles) == 0:
            return tiles
    return None


def _scales_and_zeros(scale_NG: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    scale_GN = scale_NG.t().to(dtype)
    return torch.stack([scale_GN, torch.zeros_like(scale_GN)], dim=-1).contiguous()


def pack_halves(q_NK: torch.Tensor, group_size: int) -> torch.Tensor:
    """int8 ``q [N, K]`` -> uint8 ``[N, K/2]`` in the ``halves`` layout (see the module doc)."""
    n, k = q_NK.shape
    unsigned = (q_NK.to(torch.int16) - QMIN).view(n, k // group_size, 2, group_size // 2)
    return (unsigned[:, :, 0] | (unsigned[:, :, 1] << 4)).to(torch.uint8).reshape(n, k // 2)


def unpack_halves(packed_NH: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of :func:`pack_halves`: uint8 ``[N, K/2]`` -> int8 ``q [N, K]``."""
    n, half_k = packed_NH.shape
    nibbles = packed_NH.view(n, -1, 1, group_size // 2).to(torch.int16)
    q = torch.cat([nibbles & 0xF, nibbles >> 4], dim=2) + QMIN
    return q.reshape(n, 2 * half_k).to(torch.int8)


def tile_halves(packed_NH: torch.Tensor, group_size: int, tile_rows: int) -> torch.Tensor:
    """``halves`` bytes ``[N, K/2]`` -> int32 words ``[N/T, K/gs, T, gs/8]`` (``T = tile_rows``, a divisor of N):
    word ``w`` of group ``g`` of row ``r`` at ``[r // T, g, r % T, w]``."""
    n, half_k = packed_NH.shape
    if n % tile_rows or (2 * half_k) % group_size or group_size % 8:
        raise ValueError(f"tile_halves: [{n}, {half_k}] bytes do not tile by {tile_rows} rows x groups of {group_size}")
    groups = 2 * half_k // group_size
    words = packed_NH.contiguous().view(torch.int32).view(n // tile_rows, tile_rows, groups, group_size // 8)
    return words.permute(0, 2, 1, 3).contiguous()


def halves_rows(packed: "PackedInt4") -> torch.Tensor:
    """A ``halves`` weight as uint8 rows ``[N, K/2]`` (a copy when it is stored in tiles)."""
    if not packed.tile_rows:
        return packed.weight
    tiles, groups, rows, words = packed.weight.shape
    return packed.weight.permute(0, 2, 1, 3).reshape(tiles * rows, groups * words).contiguous().view(torch.uint8)


def halves_tile_rows(out_features: int) -> int:
    """Rows per tile of a ``halves`` weight with ``out_features`` rows (0: stored as rows)."""
    if switches.value(kernel_switches.TILE_ROWS) == 0 or out_features % HALVES_TILE_ROWS:
        return 0
    return HALVES_TILE_ROWS


def pack_for_kernel(q_NK: torch.Tensor, scale_NG: torch.Tensor, act_dtype: torch.dtype,
                    layout: str | None = None) -> PackedInt4:
    """``(q int8 [N, K], scale [N, G])`` -> ``layout`` (default: the device's) on ``q``'s device."""
    layout = layout or default_layout(q_NK.device)
    out_features, in_features = q_NK.shape
    group_size = in_features // scale_NG.shape[-1]
    if layout == "halves":
        weight, tile_rows = pack_halves(q_NK, group_size), halves_tile_rows(out_features)
        if tile_rows:
            weight = tile_halves(weight, group_size, tile_rows)
        return PackedInt4(weight, scale_NG.contiguous(), group_size, out_features, layout, tile_rows)
    unsigned = q_NK.to(torch.int32) - QMIN
    if layout == "cpu":
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned.contiguous(), 1)
        return PackedInt4(weight, _scales_and_zeros(scale_NG, act_dtype), group_size, out_features, layout)
    if layout != "tinygemm":
        raise ValueError(f"int4 layout {layout!r}; use one of {LAYOUTS}")
    tiles = _inner_k_tiles(in_features)
    assert tiles is not None, f"K={in_features} has no inner_k_tiles"
    pairs = ((unsigned[:, ::2] << 4) | unsigned[:, 1::2]).to(torch.uint8).contiguous()
    weight = torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
    return PackedInt4(weight, _scales_and_zeros(scale_NG, torch.bfloat16), group_size, out_features, layout)


def small_m_limit() -> int:
    """Most token rows the Triton small-M kernel takes (``--int4-small-m``, default and cap 64)."""
    return max(0, min(switches.value(kernel_switches.SMALL_M), SMALL_M_MAX))


def uses_small_m_kernel(x_MK: torch.Tensor) -> bool:
    """Whether a ``halves`` weight is multiplied by the Triton kernel for this input (else dequantize + matmul)."""
    return x_MK.is_cuda and x_MK.dtype in (torch.bfloat16, torch.float16) and 0 < x_MK.shape[0] <= small_m_limit()


def dequantize_halves_for(x_MK: torch.Tensor, packed: PackedInt4) -> torch.Tensor:
    """The QAT forward's ``w_dq [N, K]`` in ``x``'s dtype from a ``halves`` weight: one Triton launch for CUDA
    bf16/fp16 (:mod:`miles_int4.dequant_kernel`), otherwise unpack + :func:`~miles_int4.quant.dequantize`."""
    if x_MK.is_cuda and x_MK.dtype in (torch.bfloat16, torch.float16):
        from miles_int4.dequant_kernel import dequantize_halves

        return dequantize_halves(packed.weight, packed.scales, packed.group_size, x_MK.dtype)
    return dequantize(unpack_halves(halves_rows(packed), packed.group_size), packed.scales, x_MK.dtype)


def int4_mm(x_MK: torch.Tensor, packed: PackedInt4) -> torch.Tensor:
    """``x [..., K] @ w.T`` with ``w`` in one of the layouts; output in ``x``'s dtype."""
    x_2d = x_MK.reshape(-1, x_MK.shape[-1])
    if packed.layout == "halves":
        if uses_small_m_kernel(x_2d):
            from miles_int4 import decode_gemm

            y = decode_gemm.int4_small_m_mm(x_2d, packed.weight, packed.scales, packed.group_size)
        else:
            y = F.linear(x_2d, dequantize_halves_for(x_2d, packed))
    elif packed.layout == "cpu":
        sz = packed.scales
        if sz.dtype != x_2d.dtype:
            sz = sz.to(x_2d.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x_2d.contiguous(), packed.weight, packed.group_size, sz)
    else:
        y = torch.ops.aten._weight_int4pack_mm(
            x_2d.to(torch.bfloat16).contiguous(), packed.weight, packed.group_size, packed.scales
        ).to(x_2d.dtype)
    return y.reshape(*x_MK.shape[:-1], packed.out_features)


def reference_mm(x_MK: torch.Tensor, q_NK: torch.Tensor, scale_NG: torch.Tensor) -> torch.Tensor:
    """The float reference of :func:`int4_mm`: dequantize in ``x``'s dtype, then ``F.linear``."""
    return F.linear(x_MK, dequantize(q_NK, scale_NG, x_MK.dtype))
