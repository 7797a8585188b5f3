"""Group-wise symmetric INT4: quantize, dequantize, fake-quantize (STE), int32 packing.

The one definition every path shares (QAT forward, weight sync, checkpoint
conversion, packed GEMMs), for a weight ``w`` of shape ``[..., N, K]`` (``K`` the
input dim, grouped in runs of ``group_size`` consecutive columns):

    scale = bf16(fp32(amax(|w_group|)) / 7)          one scale per row and group
    q     = clamp(round_half_even(w / scale), -8, 7)  (q = 0 where scale == 0)
    w_dq  = (fp32(q) * fp32(scale)).to(model dtype)

Scales are rounded to bfloat16 whatever the model dtype, because that is what
checkpoints and inference engines store; ``q * scale`` is then exact in float32
(4-bit times 8-bit mantissas), so the dequantized weight is the same number in
training (float32 master weights, bf16 autocast) and in rollout (bf16 weights).

Quantizing, packing and unpacking run over stacked weights (MoE experts ``[E, N, K]``) a few
matrices at a time, so their float32 / int64 temporaries stay near ``CHUNK_ELEMENTS`` elements
whatever the stack (DeepSeek-V3's ``gate_up_proj`` is 7.5 G elements: 60 GB of int64 nibbles
at once); the numbers are those of one call over the whole tensor.

Packing follows compressed-tensors' ``pack-quantized`` format: ``q + 8`` as an
unsigned nibble, 8 consecutive input columns per int32, column ``8g + i`` in bits
``4i .. 4i + 3`` of word ``g``.
"""

from __future__ import annotations

import torch

QMIN, QMAX = -8, 7
#: the dtype scales are stored (and rounded) in
SCALE_DTYPE = torch.bfloat16
GROUP_SIZES = (32, 64, 128)
PACK_FACTOR = 8  # nibbles per int32
#: elements of a stacked weight converted per step (whole matrices, at least one)
CHUNK_ELEMENTS = 1 << 26


def _chunked(fn, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """``fn(x)`` over the leading dims of ``x [..., R, C]`` a few matrices at a time, its outputs
    concatenated; None when ``x`` is one chunk anyway."""
    matrices = x.shape[:-2].numel() if x.dim() > 2 else 1
    per_chunk = max(1, CHUNK_ELEMENTS // max(1, x.shape[-2] * x.shape[-1]))
    if matrices <= per_chunk:
        return None
    flat = x.flatten(0, -3)
    outputs: list[torch.Tensor] | None = None
    for start in range(0, matrices, per_chunk):
        parts = fn(flat[start : start + per_chunk])
        parts = parts if isinstance(parts, tuple) else (parts,)
        if outputs is None:
            outputs = [torch.empty((matrices, *p.shape[1:]), dtype=p.dtype, device=p.device) for p in parts]
        for out, part in zip(outputs, parts):
            out[start : start + per_chunk] = part
    return tuple(out.unflatten(0, x.shape[:-2]) for out in outputs)


def check_groupable(name: str, shape: tuple[int, ...] | torch.Size, group_size: int) -> None:
    """ValueError naming the weight when its input dim does not split into groups."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"--int4-group-size must be one of {GROUP_SIZES}, got {group_size}")
    shape = tuple(shape)
    if len(shape) < 2 or shape[-1] % group_size:
        raise ValueError(
            f"int4: {name} has shape {shape}; its input dim {shape[-1] if shape else '?'} is not a multiple "
            f"of --int4-group-size {group_size}. Use a group size that divides it (32, 64 or 128), "
            "or --int4-target experts to quantize only the MoE experts"
        )


def quantize(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> ``(q int8 [..., N, K], scale bf16 [..., N, K // group_size])``."""
    chunked = _chunked(lambda part: quantize(part, group_size), w)
    if chunked is not None:
        return chunked
    groups = w.shape[-1] // group_size
    w_grouped = w.detach().float().unflatten(-1, (groups, group_size))
    scale = (w_grouped.abs().amax(dim=-1) / QMAX).to(SCALE_DTYPE)
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    q = torch.round(w_grouped / divisor.unsqueeze(-1)).clamp_(QMIN, QMAX).to(torch.int8)
    return q.flatten(-2), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(q [..., N, K], scale [..., N, G])`` -> ``w_dq [..., N, K]`` in ``dtype``."""
    groups = scale.shape[-1]
    q_grouped = q.float().unflatten(-1, (groups, q.shape[-1] // groups))
    return (q_grouped * scale.float().unsqueeze(-1)).flatten(-2).to(dtype)


class _FakeQuantize(torch.autograd.Function):
    """Forward: the dequantized weight; backward: the gradient unchanged (STE)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, group_size: int) -> torch.Tensor:
        q, scale = quantize(w, group_size)
        return dequantize(q, scale, w.dtype)

    @staticmethod
    def backward(ctx, grad_w: torch.Tensor):
        return grad_w, None


def fake_quantize(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """INT4 quantize-dequantize of ``w`` with a straight-through gradient (QAT)."""
    return _FakeQuantize.apply(w, group_size)


def pack_int32(q: torch.Tensor) -> torch.Tensor:
    """int8 ``q [..., N, K]`` in [-8, 7] -> int32 ``[..., N, K // 8]`` (compressed-tensors layout)."""
    if q.shape[-1] % PACK_FACTOR:
        raise ValueError(f"int4 packing needs the input dim to be a multiple of 8, got shape {tuple(q.shape)}")
    chunked = _chunked(pack_int32, q)
    if chunked is not None:
        return chunked[0]
    nibbles = (q.to(torch.int64) - QMIN).unflatten(-1, (q.shape[-1] // PACK_FACTOR, PACK_FACTOR))
    shifts = torch.arange(PACK_FACTOR, device=q.device, dtype=torch.int64) * 4
    words = (nibbles << shifts).sum(dim=-1)  # disjoint bits: sum == bitwise or, < 2**32
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as signed int32
    return words.to(torch.int32)


def unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: int32 ``[..., N, K // 8]`` -> int8 ``[..., N, K]``."""
    chunked = _chunked(unpack_int32, packed)
    if chunked is not None:
        return chunked[0]
    shifts = torch.arange(PACK_FACTOR, device=packed.device, dtype=torch.int32) * 4
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift, masked: sign bits drop out
    return (nibbles.flatten(-2) + QMIN).to(torch.int8)


def dequantize_packed(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight a ``(weight_packed, weight_scale)`` pair stands for, in ``dtype``."""
    return dequantize(unpack_int32(packed), scale, dtype)


def packed_names(name: str) -> tuple[str, str, str]:
    """``x.weight`` -> ``x.weight_packed``, ``x.weight_scale``, ``x.weight_shape`` (any name: suffixes)."""
    return f"{name}_packed", f"{name}_scale", f"{name}_shape"


def compress(name: str, w: torch.Tensor, group_size: int) -> list[tuple[str, torch.Tensor]]:
    """``(name, w)`` -> the three compressed-tensors entries of the INT4 weight."""
    check_groupable(name, w.shape, group_size)
    q, scale = quantize(w, group_size)
    packed_name, scale_name, shape_name = packed_names(name)
    shape = torch.tensor(list(w.shape), dtype=torch.int64, device=w.device)
    return [(packed_name, pack_int32(q)), (scale_name, scale), (shape_name, shape)]
