"""CPU tests of :mod:`miles_host.kernels.invariant_matmul` under Triton's interpreter (not collected by itself).

Run by ``test_invariant_matmul.py::test_cpu_kernel_under_the_triton_interpreter``
in a fresh process with ``TRITON_INTERPRET=1``; alone:
``TRITON_INTERPRET=1 python -m pytest tests/kernels/interpreted_invariant_matmul.py``.
Shapes stay small (the interpreter runs every program in numpy).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_invariant_matmul import assert_close_to_reference, assert_rows_invariant, operands
from tests.plugins.triton_interpret import interpreted_module


@pytest.fixture(scope="module")
def kernels():
    return interpreted_module("miles_host.kernels.invariant_matmul")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_the_float64_reference(kernels, dtype):
    for m, n, k in ((1, 72, 100), (17, 64, 64), (130, 40, 128)):  # K and N tails, several M tiers
        a, b, bias = operands(m, n, k, dtype, bias=True)
        got = kernels.invariant_mm(a, b, bias)
        assert got.shape == (m, n) and got.dtype == dtype
        assert_close_to_reference(got, a, b, bias)
        assert_close_to_reference(kernels.invariant_mm(a, b), a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_bitwise_invariant_across_batches(kernels, dtype):
    """M = 1, 3, 17, 64, 130 and 600 (the next tier), shuffled and offset rows, with and without bias."""
    a, b, bias = operands(620, 72, 100, dtype, bias=True)
    assert kernels.matmul_config(600, 72, 100, dtype) != kernels.matmul_config(1, 72, 100, dtype)
    assert_rows_invariant(a, b)
    full = assert_rows_invariant(a, b, bias, ms=(1, 3, 17, 64, 130, 600))
    padded = torch.cat([torch.randn(5, 100).to(dtype), a, torch.zeros(9, 100, dtype=dtype)])
    assert torch.equal(kernels.invariant_mm(padded, b, bias)[5:625], full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_alternative_config_gives_the_same_bits(kernels, dtype):
    a, b, bias = operands(70, 72, 100, dtype, bias=True)
    expected = kernels.invariant_mm(a, b, bias)
    for config in kernels.alternatives(dtype):
        assert torch.equal(kernels.invariant_mm(a, b, bias, config=config), expected), config


def test_strides_and_out_dtype(kernels):
    """Contiguous or transposed ``b``, transposed or sliced ``a``: same bits; fp32 output keeps the accumulator."""
    a, b, bias = operands(9, 40, 72, torch.bfloat16, bias=True)
    expected = kernels.invariant_mm(a, b, bias)
    assert torch.equal(kernels.invariant_mm(a, b.contiguous(), bias), expected)
    assert torch.equal(kernels.invariant_mm(a.t().contiguous().t(), b, bias), expected)
    wide = torch.zeros(9, 200, dtype=torch.bfloat16)
    wide[:, 50:122] = a
    assert torch.equal(kernels.invariant_mm(wide[:, 50:122], b, bias), expected)
    out32 = kernels.invariant_mm(a, b, bias, out_dtype=torch.float32)
    assert out32.dtype == torch.float32 and torch.equal(out32.to(torch.bfloat16), expected)


def test_empty_and_zero_k(kernels):
    a, b, bias = operands(4, 8, 16, torch.float32, bias=True)
    assert kernels.invariant_mm(a[:0], b).shape == (0, 8)
    assert torch.equal(kernels.invariant_mm(a[:, :0], b[:0], bias), bias.expand(4, 8))
