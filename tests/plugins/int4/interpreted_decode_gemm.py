"""CPU tests of :mod:`miles_int4.decode_gemm` under Triton's interpreter (not collected by itself).

Run by ``test_decode_gemm.py::test_cpu_kernel_under_the_triton_interpreter`` in a
fresh process with ``TRITON_INTERPRET=1``; alone:
``TRITON_INTERPRET=1 python -m pytest tests/plugins/int4/interpreted_decode_gemm.py``.
"""

from __future__ import annotations

import pytest
import torch

from miles_host.kernels import split_k
from miles_int4.quant import dequantize
from tests.plugins.int4.test_decode_gemm import _assert_matches, _expected, _weights, _x
from tests.kernel_switches import use_switches
from tests.plugins.triton_interpret import interpreted_module


@pytest.fixture(scope="module")
def kernels():
    return interpreted_module("miles_int4.decode_gemm")


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_dequantizes_bit_for_bit_like_qat(kernels, group_size, dtype):
    """One-hot activation rows read single weights: the kernel's dequantized values, exactly."""
    q, scale, packed = _weights(64, 256, group_size)
    columns = torch.tensor([0, 1, group_size // 2, group_size - 1, 129, 255])
    x = torch.zeros(len(columns), 256, dtype=dtype)
    x[torch.arange(len(columns)), columns] = 1
    got = kernels.int4_small_m_mm(x, packed, scale, group_size)
    assert torch.equal(got, dequantize(q, scale, dtype)[:, columns].t())


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("m", [1, pytest.param(7, marks=pytest.mark.slow), pytest.param(16, marks=pytest.mark.slow),
                               pytest.param(40, marks=pytest.mark.slow), 64])  # (slow: CI time)
def test_kernel_matches_the_reference(kernels, m, group_size, out_dtype):
    q, scale, packed = _weights(192, 512, group_size)
    x = _x(m, 512)
    got = kernels.int4_small_m_mm(x, packed, scale, group_size, out_dtype=out_dtype)
    assert got.shape == (m, 192) and got.dtype == out_dtype
    _assert_matches(got, _expected(x, q, scale), out_dtype)


def test_float16_activations_and_ragged_n(kernels):
    q, scale, packed = _weights(72, 256, 64)  # 72 rows: the last N tile is partial
    x = _x(5, 256, dtype=torch.float16)
    got = kernels.int4_small_m_mm(x, packed, scale, 64)
    assert got.dtype == torch.float16
    _assert_matches(got, _expected(x, q, scale), torch.float16)


@pytest.mark.parametrize("reduce", ["kernel", "torch"])
@pytest.mark.parametrize("split", [2, 4, 8])
def test_split_k_reductions(kernels, split, reduce, monkeypatch):
    use_switches(monkeypatch, split_k_reduce=reduce)
    counters = torch.zeros(64, dtype=torch.int32)
    monkeypatch.setattr(split_k, "semaphores", lambda device, count: counters)
    q, scale, packed = _weights(128, 1024, 64)
    x = _x(6, 1024)
    got = kernels.int4_small_m_mm(x, packed, scale, 64, out_dtype=torch.float32, split=split)
    _assert_matches(got, _expected(x, q, scale), torch.float32)
    assert not counters.any()


@pytest.mark.slow
def test_kernel_on_a_1_7b_decode_shape(kernels):
    """o_proj of Qwen3-1.7B (N = K = 2048), group 128, M = 8, planned split (interpreted: slow-ish)."""
    q, scale, packed = _weights(2048, 2048, 128)
    x = _x(8, 2048)
    _assert_matches(kernels.int4_small_m_mm(x, packed, scale, 128), _expected(x, q, scale), torch.bfloat16)


def test_bad_operands_are_value_errors(kernels):
    q, scale, packed = _weights(64, 256, 64)
    with pytest.raises(ValueError, match="<= 64"):
        kernels.int4_small_m_mm(_x(65, 256), packed, scale, 64)
    with pytest.raises(ValueError, match="bf16/fp16"):
        kernels.int4_small_m_mm(_x(2, 256, dtype=torch.float32), packed, scale, 64)
    with pytest.raises(ValueError, match="group size"):
        kernels.int4_small_m_mm(_x(2, 256), packed, scale, 32)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_dequantizes_bit_for_bit_like_qat(kernels, group_size, dtype):
    """One token (the CUDA-core GEMV): a one-hot row reads one weight, at every position of a word."""
    q, scale, packed = _weights(40, 256, group_size)  # 40 rows: a partial last tile
    expected = dequantize(q, scale, dtype)
    for column in [0, 1, 2, 3, 5, group_size // 2, group_size // 2 + 3, group_size - 1, 130, 255]:
        x = torch.zeros(1, 256, dtype=dtype)
        x[0, column] = 1
        assert torch.equal(kernels.int4_small_m_mm(x, packed, scale, group_size)[0], expected[:, column]), column


@pytest.mark.parametrize("split", [None, 2, 4])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gemv_matches_the_reference(kernels, out_dtype, split):
    q, scale, packed = _weights(96, 1024, 64)
    x = _x(1, 1024)
    got = kernels.int4_small_m_mm(x, packed, scale, 64, out_dtype=out_dtype, split=split)
    assert got.shape == (1, 96) and got.dtype == out_dtype
    _assert_matches(got, _expected(x, q, scale), out_dtype)


@pytest.mark.parametrize("tile_rows", [pytest.param(32, marks=pytest.mark.slow), 64])  # (slow: CI time)
def test_tiled_halves_give_the_row_layout_sums_bit_for_bit(kernels, tile_rows):
    """The tile-by-tile storage (one tile's bytes of a group contiguous): same products, same order, both kernels,
    tiles smaller than, equal to and larger than a program's rows."""
    from miles_int4.kernels import tile_halves

    q, scale, packed = _weights(128, 512, 64)
    tiles = tile_halves(packed, 64, tile_rows)
    assert tiles.shape == (128 // tile_rows, 512 // 64, tile_rows, 8)
    assert torch.equal(tiles[1, 2, 3], packed.view(torch.int32)[tile_rows + 3, 16:24])
    x = _x(1, 512)
    for block_n, split in [(32, 1), (64, 4), (128, 2)]:
        rows = kernels._int4_gemv(x, packed, scale, 64, torch.empty(1, 128), block_n=block_n, warps=2, split=split)
        tiled = kernels._int4_gemv(x, tiles, scale, 64, torch.empty(1, 128), block_n=block_n, warps=2, split=split)
        assert torch.equal(rows, tiled), (block_n, split)
    _assert_matches(tiled, _expected(x, q, scale), torch.float32)
    x = _x(5, 512)
    for split in (1, 2):
        rows = kernels.int4_small_m_mm(x, packed, scale, 64, split=split)
        assert torch.equal(kernels.int4_small_m_mm(x, tiles, scale, 64, split=split), rows)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.int4_small_m_mm(x, tiles[:, :4].contiguous(), scale, 64)
    with pytest.raises(ValueError, match="do not tile"):
        tile_halves(packed[:100], 64, tile_rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size,tile_rows", [(32, 0), (64, 64), (128, 128)])
def test_prefill_dequantization_kernel_is_the_qat_weight(dtype, group_size, tile_rows):
    """One launch from rows or tiles (ragged last program of rows included) to the QAT forward's weight, bit for bit."""
    from miles_int4.dequant_kernel import dequantize_halves
    from miles_int4.kernels import tile_halves

    rows = 200 if not tile_rows else 256
    q, scale, packed = _weights(rows, 512, group_size)
    weight = tile_halves(packed, group_size, tile_rows) if tile_rows else packed
    assert torch.equal(dequantize_halves(weight, scale, group_size, dtype), dequantize(q, scale, dtype))
