"""Triton helpers of the small-M GEMMs: exact rounding and the split-K epilogue (see :mod:`.split_k`).

Rounding: on the GPU ``x.to(tl.bfloat16)`` is one ``cvt.rn`` instruction, but
Triton's CPU interpreter truncates it (and its "rtne" mode rounds ties away from
zero), so under the interpreter (``EMULATE=True``) the kernels round with integer
arithmetic instead: bit for bit what the GPU instruction and ``torch.Tensor.to`` do.
The interpreter's ``dot`` also reads bfloat16 operands as raw integers, so
:func:`dot` multiplies exact float32 copies there.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_bf16(x):
    """Nearest-even bfloat16 value of float32 ``x`` (finite), still as float32, by integer arithmetic."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def cast_rne(x, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """Float32 ``x`` to ``DTYPE`` rounding to nearest even (as ``torch.Tensor.to``)."""
    if DTYPE == tl.float32:
        return x
    elif DTYPE == tl.bfloat16:
        if EMULATE:
            return round_to_bf16(x).to(DTYPE)
        else:
            return x.to(DTYPE, fp_downcast_rounding="rtne")
    else:
        return x.to(DTYPE)  # float16: cvt.rn on the GPU, numpy's nearest-even in the interpreter


@triton.jit
def dot(a, b, acc, EMULATE: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation (under the interpreter on exact float32 copies)."""
    if EMULATE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def split_k_epilogue(
    acc, y_ptr, part_ptr, sem_ptr, y_offs, part_offs, mask, tile, pid_k, split_stride,
    SPLIT_K: tl.constexpr, REDUCE_IN_KERNEL: tl.constexpr, EMULATE: tl.constexpr,
):
    """Store a program's fp32 tile ``acc``: directly, or as partial ``pid_k`` of a split-K reduction.

    The last of the ``SPLIT_K`` programs of ``tile`` to arrive (atomic counter
    ``sem_ptr[tile]``, acquire-release at GPU scope, after a CTA barrier so that
    every thread's partial store is ordered before it) adds the partials in split
    order (deterministic whatever the arrival order), stores the output and
    resets the counter. Partials are read with ``.cg`` (L2, not a stale L1 line).
    """
    if SPLIT_K == 1:
        tl.store(y_ptr + y_offs, cast_rne(acc, y_ptr.dtype.element_ty, EMULATE), mask=mask)
    else:
        tl.store(part_ptr + pid_k * split_stride + part_offs, acc, mask=mask)
        if REDUCE_IN_KERNEL:
            tl.debug_barrier()
            arrived = tl.atomic_add(sem_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                total = tl.zeros_like(acc)
                for split in tl.static_range(SPLIT_K):
                    total += tl.load(part_ptr + split * split_stride + part_offs, mask=mask, other=0.0,
                                     cache_modifier=".cg")
                tl.store(y_ptr + y_offs, cast_rne(total, y_ptr.dtype.element_ty, EMULATE), mask=mask)
                tl.atomic_xchg(sem_ptr + tile, 0, sem="relaxed", scope="gpu")


def emulate_rounding() -> bool:
    """Whether kernels run under Triton's interpreter (``TRITON_INTERPRET=1``) and must round by hand."""
    return bool(triton.knobs.runtime.interpret)
