"""CPU tests of :mod:`miles_fp8.decode_gemm` under Triton's interpreter (not collected by itself).

Run by ``test_decode_gemm.py::test_cpu_kernels_under_the_triton_interpreter`` in a
fresh process with ``TRITON_INTERPRET=1``; alone:
``TRITON_INTERPRET=1 python -m pytest tests/plugins/fp8/interpreted_decode_gemm.py``.
"""

from __future__ import annotations

import pytest
import torch

from miles_fp8.quant import quantize_act_ref
from miles_host.kernels import split_k
from tests.plugins.fp8.test_decode_gemm import _activations, _assert_matches, _operands
from tests.kernel_switches import use_switches
from tests.plugins.triton_interpret import interpreted_module


@pytest.fixture(scope="module")
def kernels():
    return interpreted_module("miles_fp8.decode_gemm")


@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_kernel_quantization_is_bitwise_the_reference(kernels, dtype, power_of_two):
    x = _activations(6, 384, dtype)
    x[0, :128] = 0  # an all-zero group: scale eps / 448, q = 0
    # ties of the E4M3 grid (normal and subnormal), the largest value and values just below it
    ties = torch.tensor([0.5, 1.5, 2.5, 7.5, 8.5]) * 2.0**-9
    row = torch.cat([ties, -ties, torch.tensor([1.0625, 1.1875, 1.3125, 440.0, 432.0, 424.0, 448.0, 447.9])])
    x[1, 128:256] = 0
    x[1, 128:128 + row.numel()] = row.to(dtype)
    q, scale = kernels.quantize_rows(x, power_of_two)
    q_ref, scale_ref = quantize_act_ref(x, power_of_two)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q, q_ref.float())


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("m", [1, 5, 16, 33, 64])
def test_fused_gemm_matches_the_reference(kernels, m, power_of_two, out_dtype):
    x, w_q, w_s, expected = _operands(m, 256, 512, power_of_two=power_of_two)
    got = kernels.fused_act_quant_mm(x, w_q, w_s, power_of_two, out_dtype=out_dtype)
    assert got.shape == (m, 256) and got.dtype == out_dtype
    _assert_matches(got, expected, out_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_gemm_other_activation_dtypes(kernels, dtype):
    x, w_q, w_s, expected = _operands(3, 128, 256, dtype=dtype)
    got = kernels.fused_act_quant_mm(x, w_q, w_s)
    assert got.dtype == dtype
    _assert_matches(got, expected, dtype)


@pytest.mark.parametrize("reduce", ["kernel", "torch"])
@pytest.mark.parametrize("split", [2, 4, 8])
def test_split_k_reductions(kernels, split, reduce, monkeypatch):
    """Every split and both reductions give the reference; the in-kernel one leaves its counters at zero."""
    use_switches(monkeypatch, split_k_reduce=reduce)
    counters = torch.zeros(64, dtype=torch.int32)
    monkeypatch.setattr(split_k, "semaphores", lambda device, count: counters)
    x, w_q, w_s, expected = _operands(7, 256, 1024)
    got = kernels.fused_act_quant_mm(x, w_q, w_s, out_dtype=torch.float32, split=split)
    _assert_matches(got, expected, torch.float32)
    assert not counters.any()


def test_fp8_mma_option_and_strided_input(kernels):
    """The benchmark-only FP8-MMA variant (exact in the interpreter) and a non-contiguous x."""
    x, w_q, w_s, expected = _operands(4, 128, 256)
    config = kernels.SmallMConfig(block_m=16, block_n=64, num_warps=4, num_stages=2, fp8_mma=True)
    _assert_matches(kernels.fused_act_quant_mm(x, w_q, w_s, out_dtype=torch.float32, config=config),
                    expected, torch.float32)
    wide = torch.zeros(4, 512, dtype=x.dtype)
    wide[:, 128:384] = x
    _assert_matches(kernels.fused_act_quant_mm(wide[:, 128:384], w_q, w_s, out_dtype=torch.float32),
                    expected, torch.float32)


@pytest.mark.slow
def test_fused_gemm_on_a_1_7b_decode_shape(kernels):
    """o_proj of Qwen3-1.7B (N = K = 2048) at M = 8 with the planned split (interpreted: slow-ish)."""
    x, w_q, w_s, expected = _operands(8, 2048, 2048)
    _assert_matches(kernels.fused_act_quant_mm(x, w_q, w_s), expected, torch.bfloat16)


def test_bad_operands_are_value_errors(kernels):
    x, w_q, w_s, _ = _operands(2, 128, 256)
    with pytest.raises(ValueError, match="rows > 64"):
        kernels.fused_act_quant_mm(torch.zeros(65, 256), w_q, w_s)
    with pytest.raises(ValueError, match="w_scale"):
        kernels.fused_act_quant_mm(x, w_q, w_s[:, :1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        kernels.fused_act_quant_mm(x, w_q.float(), w_s)


@pytest.mark.parametrize("rows", [1, 5, 32, 77])
@pytest.mark.parametrize("power_of_two", [False, True])
def test_quantize_act_kernel_many_rows_per_program_is_bitwise_the_reference(rows, power_of_two):
    """The training-path quantizer (``triton_kernels.quantize_act``, 32 rows per program, masked tail)."""
    triton_kernels = interpreted_module("miles_fp8.triton_kernels")
    x = _activations(rows, 256, torch.bfloat16)
    x[0, :128] = 0  # an all-zero group
    q, scale = triton_kernels.quantize_act(x, power_of_two)
    q_ref, scale_ref = quantize_act_ref(x, power_of_two)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.float(), q_ref.float())
