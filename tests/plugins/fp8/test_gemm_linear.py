"""The block-scaled GEMM reference and the FP8 linears (CPU emulation) against float64 formulas."""

from __future__ import annotations

import pytest
import torch

from miles_fp8.device import check_fp8_capability
from miles_fp8.gemm import block_scaled_mm, block_scaled_mm_ref
from miles_fp8.linear import Fp8InferenceLinear, Fp8Linear
from miles_fp8.quant import quantize_act_ref, quantize_weight_ref

from .conftest import quantize64


def _deq64(q, scale, block_rows):
    return q.double() * scale.double().repeat_interleave(block_rows, 0).repeat_interleave(128, 1)


@pytest.mark.parametrize("b_block_rows", [128, 1])
def test_block_scaled_mm_reference_equals_dequantize_then_matmul_float64(b_block_rows):
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(37, 384, generator=generator)
    b = torch.randn(256, 384, generator=generator) * 0.02
    a_q, a_s = quantize_act_ref(a)
    b_q, b_s = quantize_weight_ref(b) if b_block_rows == 128 else quantize_act_ref(b)
    expected = _deq64(a_q, a_s, 1) @ _deq64(b_q, b_s, b_block_rows).T
    got = block_scaled_mm_ref(a_q, a_s, b_q, b_s, torch.float32)
    torch.testing.assert_close(got.double(), expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    assert torch.equal(block_scaled_mm(a_q, a_s, b_q, b_s, torch.float32), got)  # CPU dispatch = reference


def test_fp8_linear_forward_within_fp8_error_of_float64_linear():
    """|y_fp8 - y| <= sum_k (|x|+ex)(|w|+ew) - |x||w| with ex, ew the per-element E4M3 bounds."""
    generator = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(256, 128, bias=True)
    x = torch.randn(5, 7, 256, generator=generator)
    fp8 = Fp8Linear.from_linear(linear, name="test")
    y = fp8(x)
    assert y.shape == (5, 7, 128)
    x64, w64 = x.reshape(-1, 256).double(), linear.weight.double()
    _, _, sx = quantize64(x64, 1)
    _, _, sw = quantize64(w64, 128)
    ex = torch.maximum(x64.abs() * 2.0**-4, sx * 2.0**-10)
    ew = torch.maximum(w64.abs() * 2.0**-4, sw * 2.0**-10)
    bound = (x64.abs() + ex) @ (w64.abs() + ew).T - x64.abs() @ w64.abs().T
    exact = x64 @ w64.T + linear.bias.double()
    error = (y.reshape(-1, 128).double() - exact).abs()
    assert torch.all(error <= bound + 1e-5)
    assert error.max() > 0  # it really is quantized


def test_fp8_linear_gradients_match_fp32_emulation_formula():
    """dx = deq Q(dy) @ deq Qw(W); dW = deq Q(dy^T) @ deq Q(x^T)^T (token dim in 1x128 groups); db = sum dy."""
    generator = torch.Generator().manual_seed(2)
    linear = torch.nn.Linear(256, 384, bias=True)
    fp8 = Fp8Linear.from_linear(linear, name="test")
    assert fp8.weight is linear.weight  # the master weight itself
    x = torch.randn(37, 256, generator=generator, requires_grad=True)
    dy = torch.randn(37, 384, generator=generator)
    (fp8(x) * dy).sum().backward()

    pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, 128 - 37))  # noqa: E731
    dyq, _, dys = quantize64(dy, 1)
    wq, _, ws = quantize64(linear.weight.detach(), 128)
    dx_expected = (dyq * dys) @ (wq * ws)
    dyTq, _, dyTs = quantize64(pad(dy).T, 1)
    xTq, _, xTs = quantize64(pad(x.detach()).T, 1)
    dw_expected = (dyTq * dyTs) @ (xTq * xTs).T
    torch.testing.assert_close(x.grad.double(), dx_expected, atol=1e-4 * dx_expected.abs().max().item(), rtol=0)
    torch.testing.assert_close(linear.weight.grad.double(), dw_expected, atol=1e-4 * dw_expected.abs().max().item(), rtol=0)
    torch.testing.assert_close(linear.bias.grad, dy.sum(0), atol=1e-4, rtol=1e-5)
    # and the FP8 gradient is close to the exact one
    exact_dw = dy.double().T @ x.detach().double()
    assert (linear.weight.grad.double() - exact_dw).norm() / exact_dw.norm() < 0.05


def test_master_weight_trains():
    linear = torch.nn.Linear(128, 128, bias=False)
    fp8 = Fp8Linear.from_linear(linear, name="test")
    before = fp8.weight.detach().clone()
    optimizer = torch.optim.SGD(fp8.parameters(), lr=0.1)
    fp8(torch.randn(4, 128)).square().sum().backward()
    optimizer.step()
    assert not torch.equal(before, fp8.weight.detach())


def test_inference_linear_equals_training_forward():
    linear = torch.nn.Linear(256, 128, bias=True)
    train = Fp8Linear.from_linear(linear, name="t")
    rollout = Fp8InferenceLinear.from_linear(linear, name="r")
    assert rollout.weight.dtype == torch.float8_e4m3fn and rollout.weight_scale_inv.shape == (1, 2)
    x = torch.randn(3, 9, 256)
    with torch.no_grad():
        assert torch.equal(train(x), rollout(x))


def test_inference_linear_keeps_fp8_dtypes_under_model_to():
    rollout = Fp8InferenceLinear.from_linear(torch.nn.Linear(128, 128), name="r")
    rollout.to(torch.bfloat16)
    assert rollout.weight.dtype == torch.float8_e4m3fn and rollout.weight_scale_inv.dtype == torch.float32
    assert rollout.bias.dtype == torch.bfloat16


def test_bad_layer_dims_name_the_layer():
    with pytest.raises(ValueError, match=r"'model.layers.0.attn.kv_a_proj' has shape \(576, 128\)"):
        Fp8Linear.from_linear(torch.nn.Linear(128, 576), name="model.layers.0.attn.kv_a_proj")
    with pytest.raises(ValueError, match="pad the layer to a multiple of 128"):
        Fp8InferenceLinear.from_linear(torch.nn.Linear(100, 128), name="x")


def test_gpu_without_fp8_is_a_clear_error():
    with pytest.raises(ValueError, match=r"compute capability >= 8.9.*A100 has 8.0.*bf16"):
        check_fp8_capability((8, 0), "A100")
    check_fp8_capability((8, 9), "L40S")
    check_fp8_capability((9, 0), "H200")


def test_fp8_linear_of_no_rows_is_empty_with_zero_gradients():
    """An expert that received no tokens (Megatron calls it with an empty input)."""
    from miles_fp8.linear import fp8_linear

    weight = torch.randn(256, 128, requires_grad=True)
    x = torch.zeros(0, 1, 128, requires_grad=True)
    y = fp8_linear(x, weight, None, False)
    assert y.shape == (0, 1, 256)
    y.sum().backward()
    assert weight.grad is not None and not weight.grad.any() and x.grad.shape == x.shape
