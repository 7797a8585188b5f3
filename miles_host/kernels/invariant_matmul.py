"""Batch-invariant matmul for ``--true-on-policy``: a row's result never depends on the other rows.

cuBLAS picks its algorithm (tile shape, split-K, stream-K) from the whole
problem shape, so row ``i`` of ``a @ b`` can change with the number of rows M.
:func:`invariant_mm` is a Triton GEMM whose reduction order is fixed per output
element: fp32 accumulation over K in ``block_k`` chunks from ``k = 0`` upwards,
no split-K, the bias added in fp32 in the epilogue and one round-to-nearest-even
to the output dtype at the end. ``block_k`` depends on the dtype only.

The tile shape matters for speed, not for the sums: small M (decode) wants many
small tiles to spread the weight stream over the SMs, large M (training, 4k-16k
rows) wants 128x128 / 128x256 tiles. :func:`matmul_config` therefore picks from
:data:`M_TIERS` by M, among configs that run the same MMA instruction family
(Hopper: ``block_m >= 64`` and ``num_warps`` a multiple of 4, so every tier is
wgmma; float32 runs the FMA path, ``input_precision="ieee"``, never TF32) and
the same ``block_k``, whose per-element results are believed to be bitwise
identical. The GPU test (``tests/kernels/test_invariant_matmul.py``) checks every
tier on the Qwen3-0.6B shapes; if a tier ever differed, set :data:`SINGLE_CONFIG`
to True (one config per dtype whatever M: :data:`SINGLE_CONFIGS`).

Tensor legend: M rows (tokens), K reduction, N outputs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from miles_host.kernels import triton_importable

#: input dtypes of the Triton kernel (the output has the input dtype unless asked otherwise)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class MatmulConfig:
    """One tile configuration of the invariant GEMM's launch."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    #: output-tile rows grouped per sweep of N (L2 reuse of b; changes the launch order only)
    group_m: int = 8


#: one to 16 rows (batch-1 decode): 64 x 256 tiles stream a weight at ~2.4 TB/s on an H100 (the LM head
#: 151,936 x 1,024 in 127.8 us against 278.9 with the 64 x 64 tile; ``python -m bench.invariant_matmul --sweep``,
#: every launch of the sweep bit-equal to the tier at 1 and 16 rows)
_GEMV_16 = MatmulConfig(64, 256, 64, num_warps=4, num_stages=4)
_DECODE_16 = MatmulConfig(64, 64, 64, num_warps=4, num_stages=4)
_PREFILL_16 = MatmulConfig(128, 128, 64, num_warps=8, num_stages=4)
_TRAIN_16 = MatmulConfig(128, 256, 64, num_warps=8, num_stages=3)
_DECODE_32 = MatmulConfig(64, 64, 32, num_warps=4, num_stages=3)
_TRAIN_32 = MatmulConfig(128, 128, 32, num_warps=8, num_stages=3)

#: dtype -> ((largest M of the tier, config), ...), smallest M first; the last tier (None) has no bound.
#: Every config of one dtype has the same ``block_k`` and MMA family: the M-dependent alternatives.
M_TIERS: dict[torch.dtype, tuple[tuple[int | None, MatmulConfig], ...]] = {
    torch.bfloat16: ((16, _GEMV_16), (512, _DECODE_16), (2048, _PREFILL_16), (None, _TRAIN_16)),
    torch.float16: ((16, _GEMV_16), (512, _DECODE_16), (2048, _PREFILL_16), (None, _TRAIN_16)),
    torch.float32: ((512, _DECODE_32), (None, _TRAIN_32)),
}

#: True: one config per dtype whatever M, :data:`SINGLE_CONFIGS` (the fallback should tiers ever
#: differ bitwise on a GPU: 128x128 tiles, a middle ground between decode and training speed)
SINGLE_CONFIG = False
SINGLE_CONFIGS = {torch.bfloat16: _PREFILL_16, torch.float16: _PREFILL_16, torch.float32: _TRAIN_32}


def alternatives(dtype: torch.dtype) -> tuple[MatmulConfig, ...]:
    """Every config :func:`matmul_config` may pick for ``dtype`` (the GPU test runs them all)."""
    return tuple(config for _, config in M_TIERS[dtype])


def matmul_config(m: int, n: int, k: int, dtype: torch.dtype) -> MatmulConfig:
    """The config of an ``[m, k] x [k, n]`` product: a tier of :data:`M_TIERS` chosen by ``m``.

    Pure function of the shape; ``n`` and ``k`` do not change the choice today
    (they may, being the same for every row of one weight).
    """
    if dtype not in M_TIERS:
        raise ValueError(f"invariant_mm supports {', '.join(map(str, DTYPES))}, not {dtype}")
    if SINGLE_CONFIG:
        return SINGLE_CONFIGS[dtype]
    for largest_m, config in M_TIERS[dtype]:
        if largest_m is None or m <= largest_m:
            return config
    raise AssertionError("the last tier has no bound")


def invariant_mm_reference(
    a_MK: torch.Tensor, b_KN: torch.Tensor, bias_N: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Plain PyTorch: the product (plus bias) in float64, rounded once to the output dtype.

    A batch-of-one ``bmm`` (not ``aten::mm``, which :mod:`.invariant_ops` may route back here).
    """
    out_MN = torch.bmm(a_MK.double().unsqueeze(0), b_KN.double().unsqueeze(0)).squeeze(0)
    if bias_N is not None:
        out_MN = out_MN + bias_N.double()
    return out_MN.to(out_dtype or a_MK.dtype)


def uses_triton(t: torch.Tensor) -> bool:
    """Whether the invariant kernels run on ``t``: CUDA, or CPU under Triton's interpreter (tests)."""
    if not triton_importable():
        return False
    return t.is_cuda or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def _check(a_MK: torch.Tensor, b_KN: torch.Tensor, bias_N: torch.Tensor | None) -> None:
    if a_MK.dim() != 2 or b_KN.dim() != 2 or a_MK.shape[1] != b_KN.shape[0]:
        raise ValueError(f"invariant_mm multiplies [M, K] x [K, N]; got {tuple(a_MK.shape)} x {tuple(b_KN.shape)}")
    if a_MK.dtype != b_KN.dtype or a_MK.dtype not in DTYPES:
        raise ValueError(f"invariant_mm needs a and b of one dtype among bf16/fp16/fp32; got {a_MK.dtype}, {b_KN.dtype}")
    if bias_N is not None and tuple(bias_N.shape) != (b_KN.shape[1],):
        raise ValueError(f"bias must have shape [N] = [{b_KN.shape[1]}]; got {tuple(bias_N.shape)}")


def invariant_mm(
    a_MK: torch.Tensor,
    b_KN: torch.Tensor,
    bias_N: torch.Tensor | None = None,
    *,
    config: MatmulConfig | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``a @ b (+ bias)`` as ``[M, N]``, each row independent of M and of the other rows.

    ``a`` and ``b``: bf16, fp16 or fp32, one dtype, any strides (``b`` is usually
    ``weight.t()`` of a ``[N, K]`` weight; nothing is copied). ``bias``: ``[N]``,
    any floating dtype, added in fp32. ``out_dtype``: the input dtype unless given
    (float32 keeps the accumulator unrounded, e.g. for logits). ``config``: force a
    tile config (tests; default :func:`matmul_config`).
    On CUDA (and on CPU under ``TRITON_INTERPRET=1``) the Triton kernel; elsewhere
    :func:`invariant_mm_reference` (float64 sums, one rounding: invariant in
    practice, slow). No autograd of its own: :mod:`.invariant_ops` puts it under
    ``aten::mm``, below autograd.
    """
    _check(a_MK, b_KN, bias_N)
    if not uses_triton(a_MK):
        return invariant_mm_reference(a_MK, b_KN, bias_N, out_dtype)
    from miles_host.kernels import _invariant_matmul_triton

    m, k = a_MK.shape
    n = b_KN.shape[1]
    config = config or matmul_config(m, n, k, a_MK.dtype)
    return _invariant_matmul_triton.mm(a_MK, b_KN, bias_N, config, out_dtype or a_MK.dtype)


def invariant_bmm(a_BMK: torch.Tensor, b_BKN: torch.Tensor, *, config: MatmulConfig | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a[i] @ b[i]`` for every batch entry ``i`` as ``[B, M, N]``: each entry's rows exactly as
    :func:`invariant_mm` of that entry computes them (the same kernel body, config by ``M``), in
    one launch. ``a`` may be a broadcast view (batch stride 0: one input for every entry, as
    ``x.expand(E, T, H)`` for every expert). No bias, no autograd.
    On CUDA (and on CPU under ``TRITON_INTERPRET=1``) the Triton kernel; elsewhere each entry's
    :func:`invariant_mm_reference`."""
    if a_BMK.dim() != 3 or b_BKN.dim() != 3 or a_BMK.shape[0] != b_BKN.shape[0] or a_BMK.shape[2] != b_BKN.shape[1]:
        raise ValueError(f"invariant_bmm multiplies [B, M, K] x [B, K, N]; got {tuple(a_BMK.shape)} x {tuple(b_BKN.shape)}")
    _check(a_BMK[0], b_BKN[0], None)
    if not uses_triton(a_BMK):
        return torch.stack([invariant_mm_reference(a, b, None, out_dtype) for a, b in zip(a_BMK, b_BKN)])
    from miles_host.kernels import _invariant_matmul_triton

    _, m, k = a_BMK.shape
    config = config or matmul_config(m, b_BKN.shape[2], k, a_BMK.dtype)
    return _invariant_matmul_triton.bmm(a_BMK, b_BKN, config, out_dtype or a_BMK.dtype)
