"""Compile a Triton kernel for an H100/H200 (sm_90) without a GPU: catches GPU-only compile errors.

The interpreter runs a kernel's ``EMULATE=True`` branches; the GPU ones (hardware
rounding, FMA division, packed bf16 math, the split-K atomics) are only compiled
on a GPU machine. :func:`compile_sm90` builds them here with Triton's bundled
``ptxas``, with the pointer and stride divisibility that Triton's launcher gives
at run time, and returns the PTX for tests to look into.
"""

from __future__ import annotations

import pytest


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, num_warps: int, num_stages: int,
                 unaligned: tuple[str, ...] = ("M",)) -> str:
    """PTX of ``fn`` for sm_90; every argument but ``unaligned`` is 16-divisible, as at run time."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name not in unaligned}
    full = {**signature, **{name: "constexpr" for name in constexprs}}
    try:
        kernel = triton.compile(ASTSource(fn=fn, signature=full, constexprs=constexprs, attrs=attrs),
                                target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": num_warps, "num_stages": num_stages})
    except FileNotFoundError as error:  # a triton build without the NVIDIA toolchain
        pytest.skip(f"cannot compile for sm_90 here: {error}")
    return kernel.asm["ptx"]
