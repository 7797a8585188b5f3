"""Triton body of :mod:`miles_host.kernels.activation` (imported only on CUDA)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_host.kernels._triton_common import TL_DTYPES, cast, round_to


@triton.jit
def _silu_and_mul_kernel(GateUp, Out, stride_in, stride_out, I, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(GateUp + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GateUp + row * stride_in + I + cols, mask=mask, other=0.0).to(tl.float32)
    act = round_to(gate / (1.0 + tl.exp(-gate)), DTYPE)
    tl.store(Out + row * stride_out + cols, cast(act * up, DTYPE), mask=mask)


def silu_and_mul(gate_up_T2I: torch.Tensor) -> torch.Tensor:
    num_rows, width = gate_up_T2I.shape
    inter = width // 2
    out = torch.empty((num_rows, inter), dtype=gate_up_T2I.dtype, device=gate_up_T2I.device)
    if num_rows:
        block = min(triton.next_power_of_2(inter), 2048)
        _silu_and_mul_kernel[(num_rows, triton.cdiv(inter, block))](
            gate_up_T2I, out, gate_up_T2I.stride(0), out.stride(0), inter, BLOCK=block, DTYPE=TL_DTYPES[gate_up_T2I.dtype], num_warps=4,
        )
    return out
