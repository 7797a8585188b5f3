"""Triton helpers shared by the fused kernels.

Triton's plain ``x.to(tl.bfloat16)`` from float32 may round toward zero; PyTorch
rounds to nearest even. Every downcast of the fused kernels goes through
:func:`cast` so results round like the eager modules they replace.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def cast(x, DTYPE: tl.constexpr):
    """float32 ``x`` to ``DTYPE`` rounding to nearest even (identity for float32)."""
    if DTYPE == tl.float32:
        return x
    else:
        return x.to(DTYPE, fp_downcast_rounding="rtne")


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """``x`` rounded to ``DTYPE`` and back to float32 (an eager op's output rounding)."""
    return cast(x, DTYPE).to(tl.float32)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of program ``pid`` on a 1-D grid over the ``M x N`` output tiles,
    ``GROUP_M`` row tiles walked together (each group's B columns stay in L2)."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


#: torch dtype -> Triton dtype of the activations the fused kernels take
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """Let the next kernel of the stream launch (programmatic dependent launch,
    :mod:`miles_host.kernels.pdl`); a no-op unless ``PDL``."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the previous kernel of the stream has completed and its writes are visible
    (:mod:`miles_host.kernels.pdl`); a no-op unless ``PDL``."""
    if PDL:
        gdc_wait()
