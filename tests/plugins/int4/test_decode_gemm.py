"""The ``halves`` INT4 layout and its small-M Triton GEMM (:mod:`miles_int4.decode_gemm`) against references.

CPU: the layout here; the kernel in ``interpreted_decode_gemm.py``, run under Triton's
interpreter in a subprocess (:func:`test_cpu_kernel_under_the_triton_interpreter`).
GPU (marked ``gpu``): ``python -m pytest tests/plugins/int4/test_decode_gemm.py -m gpu -v``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from miles_host.kernels import split_k
from miles_int4.kernels import (
    halves_rows, int4_mm, pack_for_kernel, pack_halves, reference_mm, tile_halves, unpack_halves,
)
from miles_int4.quant import dequantize, quantize
from tests.kernel_switches import use_switches
from tests.plugins.triton_interpret import run_interpreted
from tests.plugins.triton_sm90 import compile_sm90

#: (name, N, K) of a Qwen3-1.7B decoder layer's linears
SHAPES_1_7B = [("qkv_proj", 4096, 2048), ("o_proj", 2048, 2048), ("gate_up_proj", 12288, 2048), ("down_proj", 2048, 6144)]


@functools.lru_cache(maxsize=16)
def _weights(n, k, group_size, seed=0):
    """``(q, scale, halves bytes)`` of a random weight (cached: the GPU tests reuse the 1.7B shapes)."""
    generator = torch.Generator().manual_seed(seed)
    q, scale = quantize(torch.randn(n, k, generator=generator) * 0.05, group_size)
    return q, scale, pack_halves(q, group_size)


def _x(m, k, dtype=torch.bfloat16, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _expected(x, q, scale):
    """float64 product with the weight dequantized exactly as the QAT forward does (in x's dtype)."""
    return F.linear(x.double(), dequantize(q, scale, x.dtype).double())


def _assert_matches(got, expected, dtype, chain: int = 0):
    """Within ``dtype``'s rounding of the output; ``chain``: the longest run of fp32 additions into one
    output (K for an unsplit GEMM), whose rounding error grows like ``sqrt(chain)`` ulps of the sum."""
    scale = expected.abs().max().item()
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    atol = max(1e-6, 4 * 2.0**-24 * chain**0.5) * scale
    torch.testing.assert_close(got.double(), expected, rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- layout (plain PyTorch)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_halves_layout_round_trips_and_puts_each_half_in_its_nibble(group_size):
    q, _, packed = _weights(16, 256, group_size)
    assert packed.dtype == torch.uint8 and packed.shape == (16, 128)
    assert torch.equal(unpack_halves(packed, group_size), q)
    half = group_size // 2
    byte = packed[3, half + 5].item()  # group 1, byte 5
    assert byte & 0xF == q[3, group_size + 5].item() + 8
    assert byte >> 4 == q[3, group_size + half + 5].item() + 8


def test_halves_are_stored_in_tiles_of_128_rows_when_they_divide_n(monkeypatch):
    q, scale, packed = _weights(256, 256, 64)
    tiled = pack_for_kernel(q, scale, torch.bfloat16, layout="halves")
    assert tiled.tile_rows == 128 and tiled.weight.shape == (2, 4, 128, 8) and tiled.weight.dtype == torch.int32
    assert torch.equal(halves_rows(tiled), packed)
    assert torch.equal(tiled.weight, tile_halves(packed, 64, 128))
    assert pack_for_kernel(q[:96], scale[:96], torch.bfloat16, layout="halves").tile_rows == 0  # 96 rows: rows
    use_switches(monkeypatch, int4_tile_rows=0)
    rows = pack_for_kernel(q, scale, torch.bfloat16, layout="halves")
    assert rows.tile_rows == 0 and torch.equal(rows.weight, packed)


def test_halves_int4_mm_off_cuda_is_the_qat_dequantize_path():
    """Without CUDA (or above 64 rows) the halves layout dequantizes exactly as the QAT forward does."""
    q, scale, _ = _weights(256, 256, 64)
    packed = pack_for_kernel(q, scale, torch.bfloat16, layout="halves")
    assert packed.tile_rows
    for x in (_x(3, 256), _x(8, 256, dtype=torch.float32).view(2, 4, 256)):
        assert torch.equal(int4_mm(x, packed), reference_mm(x, q, scale))


def test_cpu_kernel_under_the_triton_interpreter(request):
    """Dequantization bit for bit, GEMM vs reference, split-K reductions (see interpreted_decode_gemm.py)."""
    run_interpreted(Path(__file__).with_name("interpreted_decode_gemm.py"), request)


@pytest.mark.parametrize("activation", ["bf16", "fp16"])
def test_gpu_branches_compile_for_sm90(activation):
    """The GPU-only code (packed bf16 dequantization, wgmma, the split-K semaphore) builds for an H100/H200."""
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra installs it)")
    from miles_int4 import decode_gemm

    config = decode_gemm.small_m_config(8)
    signature = {"x_ptr": f"*{activation}", "w_ptr": "*u8", "s_ptr": "*bf16", "y_ptr": f"*{activation}",
                 "part_ptr": "*fp32", "sem_ptr": "*i32", "M": "i32", "N": "i32", "stride_xm": "i32",
                 "stride_tile": "i32", "stride_row": "i32", "stride_group": "i32", "stride_sn": "i32", "stride_ym": "i32"}
    constexprs = dict(GROUPS_PER_SPLIT=4, SPLIT_K=4, REDUCE_IN_KERNEL=True, EMULATE=False, EVEN_N=True,
                      BLOCK_M=config.block_m, BLOCK_N=config.block_n, GROUP=128, HALF=64, TILE=128)
    ptx = compile_sm90(decode_gemm._int4_small_m_kernel, signature, constexprs, config.num_warps, config.num_stages)
    for instruction in ("wgmma.mma_async", "cp.async", "atom.global.gpu.acq_rel.add"):
        assert instruction in ptx, instruction
    # bf16: two weights per multiply; fp16 activations dequantize in fp32 (one rounding)
    assert ("mul.bf16x2" in ptx or "mul.rn.bf16x2" in ptx) == (activation == "bf16")


@pytest.mark.parametrize("activation,group_size,even_n", [("bf16", 128, True), ("bf16", 32, False), ("fp16", 64, True)])
def test_gemv_compiles_for_sm90(activation, group_size, even_n):
    """The one-token GEMV's GPU branch (word-pair dequantization and fp32 FMAs in inline PTX; fp16 activations:
    the plain-Triton dequantization) builds for sm_90, ragged N included."""
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra installs it)")
    from miles_int4 import decode_gemm

    signature = {"x_ptr": f"*{activation}", "w_ptr": "*i32", "s_ptr": "*bf16", "y_ptr": f"*{activation}",
                 "part_ptr": "*fp32", "sem_ptr": "*i32", "N": "i32", "stride_tile": "i32", "stride_row": "i32",
                 "stride_group": "i32", "stride_sn": "i32"}
    constexprs = dict(GROUPS_PER_SPLIT=4, SPLIT_K=4, REDUCE_IN_KERNEL=True, EMULATE=False, EVEN_N=even_n,
                      BLOCK_N=decode_gemm.GEMV_BLOCK_N, GROUP=group_size, HALF=group_size // 2,
                      TILE=decode_gemm.GEMV_BLOCK_N)
    ptx = compile_sm90(decode_gemm._int4_gemv_kernel, signature, constexprs, decode_gemm.GEMV_WARPS, 3,
                       unaligned=() if even_n else ("N",))
    pair_ptx = ("lop3.b32", "sub.rn.bf16x2", "mul.rn.bf16x2")
    for instruction in ("fma.rn.f32", "atom.global.gpu.acq_rel.add") + (pair_ptx if activation == "bf16" else ()):
        assert instruction in ptx, instruction


def test_prefill_dequantization_compiles_for_sm90():
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra installs it)")
    from miles_int4 import dequant_kernel

    signature = {"w_ptr": "*u8", "s_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "stride_tile": "i32",
                 "stride_row": "i32", "stride_group": "i32", "stride_sn": "i32", "stride_on": "i32"}
    constexprs = dict(EMULATE=False, BLOCK_R=dequant_kernel.BLOCK_R, GROUP=128, HALF=64, TILE=128)
    ptx = compile_sm90(dequant_kernel._dequantize_halves_kernel, signature, constexprs, 4, 1)
    assert "mul.rn.bf16x2" in ptx or "mul.bf16x2" in ptx


# ----------------------------------------------------------------------------- GPU

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 2, 8, 16, 32, 64])
@pytest.mark.parametrize("name,n,k", SHAPES_1_7B)
@pytest.mark.parametrize("tiled", [True, False])
def test_gpu_kernel_on_decode_shapes(name, n, k, m, group_size, tiled):
    from miles_int4 import decode_gemm

    q, scale, packed = _weights(n, k, group_size)
    packed = tile_halves(packed, group_size, 128) if tiled else packed
    x = _x(m, k)
    expected = _expected(x, q, scale)
    args = (x.cuda(), packed.cuda(), scale.cuda(), group_size)
    _assert_matches(decode_gemm.int4_small_m_mm(*args, out_dtype=torch.float32).cpu(), expected, torch.float32)
    got = decode_gemm.int4_small_m_mm(*args)
    _assert_matches(got.cpu(), expected, torch.bfloat16)
    assert torch.equal(got, decode_gemm.int4_small_m_mm(*args))  # deterministic
    one_hot = torch.zeros(16, k, dtype=torch.bfloat16, device="cuda")
    one_hot[torch.arange(16), torch.arange(16) * (k // 16)] = 1
    weights = decode_gemm.int4_small_m_mm(one_hot, *args[1:])
    assert torch.equal(weights.cpu(), dequantize(q, scale, torch.bfloat16)[:, :: k // 16].t())


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("name,n,k", SHAPES_1_7B)
@pytest.mark.parametrize("tiled", [True, False])
def test_gpu_gemv_reads_every_weight_exactly(name, n, k, group_size, tiled):
    """One token (the CUDA-core GEMV): one-hot rows at every position of a word read the QAT weights bit for bit."""
    from miles_int4 import decode_gemm

    q, scale, packed = _weights(n, k, group_size)
    packed = tile_halves(packed, group_size, 128) if tiled else packed
    expected = dequantize(q, scale, torch.bfloat16)
    args = (packed.cuda(), scale.cuda(), group_size)
    for column in [0, 1, 2, 3, 4, 5, 6, 7, group_size // 2 + 1, group_size - 1, k - 6]:
        x = torch.zeros(1, k, dtype=torch.bfloat16, device="cuda")
        x[0, column] = 1
        assert torch.equal(decode_gemm.int4_small_m_mm(x, *args)[0].cpu(), expected[:, column]), column


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("reduce", ["kernel", "torch"])
@pytest.mark.parametrize("split", [1, 2, 4, 8, 16])
def test_gpu_split_k_variants(split, reduce, monkeypatch):
    from miles_int4 import decode_gemm

    use_switches(monkeypatch, split_k_reduce=reduce)
    q, scale, packed = _weights(2048, 6144, 128)
    x = _x(8, 6144)
    got = decode_gemm.int4_small_m_mm(x.cuda(), packed.cuda(), scale.cuda(), 128, out_dtype=torch.float32, split=split)
    # split 1: one program adds all 6144 products (H200: 5e-5 off on outputs of ~16, 3.2e-6 of the max)
    _assert_matches(got.cpu(), _expected(x, q, scale), torch.float32, chain=6144 // split)
    assert not any(buffer.any() for buffer in split_k._SEMAPHORES.values())


@pytest.mark.gpu
@cuda
def test_gpu_int4_mm_in_a_cuda_graph_and_above_the_small_m_limit():
    q, scale, _ = _weights(4096, 2048, 128)
    packed = pack_for_kernel(q.cuda(), scale.cuda(), torch.bfloat16)
    assert packed.layout == "halves"
    x = _x(4, 2048).cuda()
    int4_mm(x, packed)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_mm(x, packed)
    for seed in range(3):
        x.copy_(_x(4, 2048, seed=seed + 10).cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, int4_mm(x, packed))
    big = _x(100, 2048).cuda()  # prefill rows: dequantize + F.linear, the QAT forward's own ops
    assert torch.equal(int4_mm(big, packed), reference_mm(big, q.cuda(), scale.cuda()))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("tiled", [True, False])
def test_gpu_prefill_dequantization_is_the_qat_weight(dtype, group_size, tiled):
    from miles_int4.dequant_kernel import dequantize_halves

    q, scale, packed = _weights(4096, 2048, group_size)
    weight = tile_halves(packed, group_size, 128) if tiled else packed
    got = dequantize_halves(weight.cuda(), scale.cuda(), group_size, dtype)
    assert torch.equal(got.cpu(), dequantize(q, scale, dtype))
