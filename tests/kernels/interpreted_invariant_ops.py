"""CPU tests of :mod:`miles_host.kernels.invariant_ops` under Triton's interpreter (not collected by itself).

A CPU-key registration routes ``F.linear`` / ``mean`` of CPU tensors to the Triton
kernels, run by the interpreter. Run by
``test_invariant_ops.py::test_cpu_kernels_under_the_triton_interpreter``; alone:
``TRITON_INTERPRET=1 python -m pytest tests/kernels/interpreted_invariant_ops.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.test_invariant_ops import (
    assert_linear_and_mean_rows_invariant, gradients_vs_float64, linear_operands,
)
from tests.plugins.triton_interpret import interpreted_module


@pytest.fixture(scope="module")
def ops():
    return interpreted_module("miles_host.kernels.invariant_ops")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_and_mean_rows_invariant_through_the_kernels(ops, dtype):
    x, w, b = linear_operands(130, 64, 72, dtype)
    before = ops.CALLS.copy()
    with ops.batch_invariant_aten("CPU"):
        full = assert_linear_and_mean_rows_invariant(x, w, b, (1, 3, 17, 64, 130))
        three_d = F.linear(x[:128].reshape(4, 32, 64), w, b)
    assert (ops.CALLS - before)["addmm"] > 0
    kernels = interpreted_module("miles_host.kernels.invariant_matmul")
    assert torch.equal(full[1], kernels.invariant_mm(x, w.t(), b))
    assert torch.equal(three_d.reshape(128, 72), full[1][:128])


def test_autograd_through_the_kernels(ops):
    got, expected = gradients_vs_float64(*linear_operands(20, 48, 40, torch.float32, requires_grad=True), "CPU")
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=1e-5)
