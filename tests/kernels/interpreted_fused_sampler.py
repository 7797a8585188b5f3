"""CPU tests of :mod:`miles_host.kernels.fused_sampler` under Triton's interpreter (not collected
by itself): run by ``test_fused_sampler.py::test_cpu_kernels_under_the_triton_interpreter``."""

from __future__ import annotations

import pytest

from tests.kernels.test_fused_sampler import check_against_torch_and_float64
from tests.plugins.triton_interpret import interpreted_module


@pytest.fixture(scope="module")
def kernels():
    return interpreted_module("miles_host.kernels.fused_sampler")


@pytest.mark.parametrize("vocab", [700, 3000])
@pytest.mark.parametrize("unit", [True, False])
def test_the_draw_is_the_torch_samplers_and_inverts_the_float64_cdf(kernels, vocab, unit):
    check_against_torch_and_float64(kernels.fused_sample, vocab, unit, rows=6, device="cpu")
