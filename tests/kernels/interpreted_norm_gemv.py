"""CPU tests of :mod:`miles_host.kernels.norm_gemv` under Triton's interpreter (not collected by
itself): run by ``test_norm_gemv.py::test_cpu_kernel_under_the_triton_interpreter``; alone:
``TRITON_INTERPRET=1 python -m pytest tests/kernels/interpreted_norm_gemv.py``."""

from __future__ import annotations

import pytest

from tests.kernels.test_norm_gemv import check_norm_gemv, pending_norm
from tests.kernels.test_small_m_gemm import operands
from tests.plugins.triton_interpret import interpreted_module


@pytest.fixture(scope="module")
def kernels():
    return interpreted_module("miles_host.kernels.norm_gemv")


@pytest.mark.parametrize("residual, unit_offset", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("k, block_k, split", [(512, 128, 1), (768, 256, 3), (1024, 256, 2)])
def test_the_fused_norm_gives_the_references(kernels, residual, unit_offset, k, block_k, split):
    from miles_host.kernels.small_m_gemm import Launch

    _, w = operands(1, 64, k)
    check_norm_gemv(kernels.norm_gemv, pending_norm(k, residual, unit_offset), w, Launch("gemv", 16, block_k, split, 4, 1))
