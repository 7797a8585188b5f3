"""INT4 group quantization against an independent float64 formula; STE; int32 packing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles_int4.quant import (
    check_groupable, compress, dequantize, dequantize_packed, fake_quantize, pack_int32, quantize, unpack_int32,
)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even), by bit arithmetic."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def reference(w: np.ndarray, group_size: int):
    """float64: scale = bf16(fp32(amax / 7)), q = clip(round_half_even(w / scale), -8, 7), w_dq = q * scale."""
    grouped = w.astype(np.float64).reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    # float64 quotient rounded to float32 equals float32 division (double rounding is innocuous for /)
    scale = bf16_round((np.abs(grouped).max(axis=-1) / 7).astype(np.float32)).astype(np.float64)
    ratio = grouped / np.where(scale == 0, 1.0, scale)[..., None]
    q = np.clip(np.round(ratio), -8, 7)
    return q.reshape(w.shape), scale, (q * scale[..., None]).reshape(w.shape), ratio.reshape(w.shape)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("shape", [(48, 256), (3, 40, 128)])
def test_quantize_matches_float64_formula(group_size, shape):
    torch.manual_seed(group_size)
    w = torch.randn(shape) * torch.rand(shape[:-1] + (1,)) * 0.2
    w[..., 0, :group_size] = 0  # an all-zero group: scale 0, q 0
    w[..., 1, 5] = 3.0  # an outlier group
    q, scale = quantize(w, group_size)
    ref_q, ref_scale, ref_w, ratio = reference(w.numpy(), group_size)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16
    assert scale.shape == (*shape[:-1], shape[-1] // group_size)
    np.testing.assert_array_equal(scale.float().numpy(), ref_scale)
    differ = q.numpy() != ref_q
    # float32 w / scale may round across an exact .5 where the float64 quotient does not
    near_tie = np.abs(np.abs(ratio) % 1 - 0.5) < 1e-5
    assert not (differ & ~near_tie).any()
    assert differ.sum() <= 2
    w_dq = fake_quantize(w, group_size)
    np.testing.assert_array_equal(w_dq.numpy()[~differ], ref_w.astype(np.float32)[~differ])
    assert int(q.min()) >= -8 and int(q.max()) <= 7


def test_stacked_weights_convert_a_few_matrices_at_a_time(monkeypatch):
    """Experts ``[E, N, K]`` (and deeper stacks) in chunks of whole matrices: the float64 formula's
    numbers, and the packing round trip, as in one call."""
    from miles_int4 import quant

    torch.manual_seed(7)
    w = torch.randn(7, 24, 256) * 0.1
    whole = quantize(w, 32)
    monkeypatch.setattr(quant, "CHUNK_ELEMENTS", 24 * 256 * 3)  # 3 matrices a step, a ragged last step
    q, scale = quantize(w, 32)
    assert torch.equal(q, whole[0]) and torch.equal(scale, whole[1])
    ref_q, ref_scale, _, ratio = reference(w.numpy(), 32)
    np.testing.assert_array_equal(scale.float().numpy(), ref_scale)
    near_tie = np.abs(np.abs(ratio) % 1 - 0.5) < 1e-5
    assert not ((q.numpy() != ref_q) & ~near_tie).any()
    packed = pack_int32(q)
    assert packed.shape == (7, 24, 32) and torch.equal(unpack_int32(packed), q)
    monkeypatch.setattr(quant, "CHUNK_ELEMENTS", 1 << 26)
    assert torch.equal(pack_int32(q), packed)
    deeper = torch.randn(2, 3, 8, 64)
    monkeypatch.setattr(quant, "CHUNK_ELEMENTS", 8 * 64)
    assert [t.shape for t in quantize(deeper, 32)] == [deeper.shape, (2, 3, 8, 2)]


def test_rounding_is_half_to_even_and_scale_is_amax_over_7():
    group = torch.zeros(1, 32)
    group[0, :4] = torch.tensor([7.0, 3.5, -2.5, 0.5])  # amax 7 -> scale exactly 1
    q, scale = quantize(group, 32)
    assert float(scale) == 1.0
    assert q[0, :4].tolist() == [7, 4, -2, 0]


def test_dequantize_is_exact_in_float32_and_cast_once_to_the_model_dtype():
    torch.manual_seed(0)
    w = torch.randn(16, 128)
    q, scale = quantize(w, 64)
    exact = q.double() * scale.double().repeat_interleave(64, dim=-1)
    assert torch.equal(dequantize(q, scale, torch.float32).double(), exact)
    assert torch.equal(dequantize(q, scale, torch.bfloat16), exact.float().to(torch.bfloat16))


def test_straight_through_gradient():
    torch.manual_seed(1)
    w = torch.randn(8, 64, requires_grad=True)
    upstream = torch.randn(8, 64)
    (fake_quantize(w, 32) * upstream).sum().backward()
    assert torch.equal(w.grad, upstream)

    # through a matmul: dL/dw is dL/dw_fq (the gradient at the quantized weight)
    x = torch.randn(5, 64)
    w.grad = None
    torch.nn.functional.linear(x, fake_quantize(w, 32)).pow(2).sum().backward()
    w_fq = fake_quantize(w, 32).detach().requires_grad_(True)
    torch.nn.functional.linear(x, w_fq).pow(2).sum().backward()
    assert torch.equal(w.grad, w_fq.grad)


def test_pack_layout_is_compressed_tensors():
    torch.manual_seed(2)
    q = torch.randint(-8, 8, (3, 5, 32), dtype=torch.int8)
    packed = pack_int32(q)
    assert packed.dtype == torch.int32 and packed.shape == (3, 5, 4)
    # word g holds columns 8g..8g+7, column 8g+i as the unsigned nibble q+8 in bits 4i..4i+3
    words = packed.numpy().view(np.uint32)
    unsigned = q.numpy().astype(np.int64) + 8
    expected = np.zeros(words.shape, dtype=np.uint64)
    for i in range(8):
        expected |= unsigned[..., i::8].astype(np.uint64) << np.uint64(4 * i)
    np.testing.assert_array_equal(words, expected.astype(np.uint32))
    assert torch.equal(unpack_int32(packed), q)
    one = torch.tensor([[-8, -7, 0, 1, 2, 3, 6, 7]], dtype=torch.int8)
    assert int(pack_int32(one)[0, 0]) & 0xFFFFFFFF == 0xFEBA9810  # nibbles 15,14,11,10,9,8,1,0 high to low


def test_compress_names_dtypes_and_round_trip():
    torch.manual_seed(3)
    w = torch.randn(64, 128)
    entries = dict(compress("layers.0.attn.qkv_proj.weight", w, 32))
    assert set(entries) == {f"layers.0.attn.qkv_proj.weight_{s}" for s in ("packed", "scale", "shape")}
    packed, scale, shape = (entries[f"layers.0.attn.qkv_proj.weight_{s}"] for s in ("packed", "scale", "shape"))
    assert (packed.dtype, scale.dtype, shape.dtype) == (torch.int32, torch.bfloat16, torch.int64)
    assert shape.tolist() == [64, 128] and packed.shape == (64, 16) and scale.shape == (64, 4)
    assert torch.equal(dequantize_packed(packed, scale, torch.float32), fake_quantize(w, 32))


def test_group_size_that_does_not_divide_names_the_layer_and_shape():
    with pytest.raises(ValueError, match=r"layers\.3\.mlp\.down_proj\.weight has shape \(64, 96\).*--int4-group-size 64"):
        check_groupable("layers.3.mlp.down_proj.weight", (64, 96), 64)
    with pytest.raises(ValueError, match="must be one of"):
        check_groupable("x.weight", (64, 96), 48)
