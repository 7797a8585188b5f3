"""Block-scaled E4M3 quantization against a float64 formula written here."""

from __future__ import annotations

import pytest
import torch

from miles_fp8.quant import (
    FP8_DTYPE, dequantize, quantize_act_ref, quantize_weight_ref, round_scale_up_to_power_of_two,
)

from .conftest import GRID, nearest_e4m3, quantize64


def _wide_range(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Values spanning 6 decades across groups (and an all-zero group) so subnormals and big blocks both occur."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator) * torch.logspace(-4, 2, cols)[torch.randperm(cols, generator=generator)]
    x[0, :128] = 0.0
    return x


def test_grid_is_e4m3():
    """The test's own grid is the format torch implements (256 codes minus two NaNs)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).double()
    finite = torch.unique(codes[~codes.isnan()])
    assert torch.equal(torch.sort(finite).values, torch.unique(GRID))


@pytest.mark.parametrize("power_of_two", [False, True])
def test_activation_quantize_matches_float64_formula(power_of_two):
    x = _wide_range(6, 512)
    q, scale = quantize_act_ref(x, power_of_two)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (6, 4)
    q64, scale64, expanded = quantize64(x, 1, power_of_two=power_of_two)
    assert torch.equal(scale.double(), scale64)
    # q is a nearest E4M3 value of x / scale (ties could go either way)
    _, distance = nearest_e4m3(x.double() / expanded)
    assert torch.all((q.double() - (x.double() / expanded).clamp(-448, 448)).abs() <= distance + 1e-12)
    assert (q.double() != q64).float().mean() < 1e-3


@pytest.mark.parametrize("power_of_two", [False, True])
def test_weight_quantize_matches_float64_formula(power_of_two):
    w = _wide_range(256, 384, seed=1)
    q, scale = quantize_weight_ref(w, power_of_two)
    assert scale.shape == (2, 3)
    q64, scale64, _ = quantize64(w, 128, power_of_two=power_of_two)
    assert torch.equal(scale.double(), scale64)
    assert torch.equal(q.double(), q64)


def test_round_trip_error_within_e4m3_bound():
    """|x - dequant(q)| <= scale * max(|x/scale| * 2^-4, 2^-10): half an E4M3 ulp (normal / subnormal)."""
    for quantize, block_rows in ((quantize_act_ref, 1), (quantize_weight_ref, 128)):
        x = _wide_range(256, 384, seed=2)
        q, scale = quantize(x)
        back = dequantize(q, scale).double()
        _, _, expanded = quantize64(x, block_rows)
        bound = expanded * torch.maximum((x.double() / expanded).abs() * 2.0**-4, torch.full_like(expanded, 2.0**-10))
        assert torch.all((back - x.double()).abs() <= bound * (1 + 1e-6))
        # the block maximum is represented exactly up to fp32 rounding of the scale
        assert (back.abs().max() - x.abs().max()).abs() <= x.abs().max() * 2.0**-20


def test_experts_are_quantized_per_expert():
    w = torch.randn(3, 256, 128)
    w[1] *= 1000.0
    q, scale = quantize_weight_ref(w)
    assert scale.shape == (3, 2, 1)
    for expert in range(3):
        q_e, scale_e = quantize_weight_ref(w[expert])
        assert torch.equal(q[expert].view(torch.uint8), q_e.view(torch.uint8)) and torch.equal(scale[expert], scale_e)


def test_power_of_two_scales_are_powers_of_two_and_not_smaller():
    generator = torch.Generator().manual_seed(3)
    scale = torch.rand(1000, generator=generator) * torch.logspace(-30, 30, 1000)
    scale = torch.cat([scale, torch.tensor([1.0, 0.5, 2.0**-20, 3.0])])
    rounded = round_scale_up_to_power_of_two(scale)
    mantissa, _ = torch.frexp(rounded)
    assert torch.all(mantissa == 0.5)
    assert torch.all(rounded >= scale) and torch.all(rounded < 2 * scale)
    assert torch.equal(rounded[-4:], torch.tensor([1.0, 0.5, 2.0**-20, 4.0]))
    x = _wide_range(4, 256)
    _, act_scale = quantize_act_ref(x, power_of_two=True)
    assert torch.all(torch.frexp(act_scale)[0] == 0.5)


def test_zero_group_quantizes_to_zero():
    q, scale = quantize_act_ref(torch.zeros(2, 128))
    assert torch.all(q.float() == 0) and torch.all(scale > 0)


@pytest.mark.parametrize("shape", [(4, 100), (130, 256)])
def test_weight_dims_not_divisible_raise_clear_error(shape):
    with pytest.raises(ValueError, match=r"divisible by 128.*'weight' has shape .*bf16"):
        quantize_weight_ref(torch.randn(*shape))


def test_activation_dims_not_divisible_raise_clear_error():
    with pytest.raises(ValueError, match="divisible by 128"):
        quantize_act_ref(torch.randn(3, 96))
