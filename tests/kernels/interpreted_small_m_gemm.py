"""CPU tests of :mod:`miles_host.kernels.small_m_gemm` under Triton's interpreter (not collected
by itself): run by ``test_small_m_gemm.py::test_cpu_kernel_under_the_triton_interpreter``;
alone: ``TRITON_INTERPRET=1 python -m pytest tests/kernels/interpreted_small_m_gemm.py``."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_switches import use_switches
from tests.kernels.test_small_m_gemm import assert_within_rounding, operands
from tests.plugins.triton_interpret import interpreted_module


@pytest.fixture(scope="module")
def kernels():
    return interpreted_module("miles_host.kernels.small_m_gemm")


@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("split", [1, 2, 4])
def test_every_split_gives_the_float64_reference(kernels, m, split):
    x, w = operands(m, 128, 512)
    assert_within_rounding(kernels.small_m_linear(x, w, split=split), kernels.small_m_linear_reference(x, w))


def test_the_splits_are_summed_in_split_order_in_the_kernel_and_by_torch(kernels, monkeypatch):
    x, w = operands(2, 192, 1024)
    in_kernel = kernels.small_m_linear(x, w, split=8)
    use_switches(monkeypatch, split_k_reduce="torch")
    by_torch = kernels.small_m_linear(x, w, split=8)
    assert torch.equal(in_kernel, by_torch)


def test_the_planned_split(kernels):
    x, w = operands(1, 256, 1024)
    assert_within_rounding(kernels.small_m_linear(x, w), kernels.small_m_linear_reference(x, w))


@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("block_n, block_k", [(16, 128), (32, 256)])
def test_the_one_token_gemv_gives_the_float64_reference(kernels, split, block_n, block_k):
    x, w = operands(1, 128, 1024)
    launch = kernels.Launch("gemv", block_n, block_k, split, 4, 1)
    assert_within_rounding(kernels.small_m_linear(x, w, launch=launch), kernels.small_m_linear_reference(x, w))


def test_a_gemv_launch_falls_back_to_the_mma_kernel_for_several_tokens(kernels):
    x, w = operands(3, 128, 512)
    got = kernels.small_m_linear(x, w, launch=kernels.Launch("gemv", 16, 128, 2, 4, 1))
    assert_within_rounding(got, kernels.small_m_linear_reference(x, w))
