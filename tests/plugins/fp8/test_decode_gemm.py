"""The fused small-M FP8 kernel (:mod:`miles_fp8.decode_gemm`) against the plain-PyTorch reference.

CPU: ``interpreted_decode_gemm.py`` runs under Triton's interpreter in a subprocess
(:func:`test_cpu_kernels_under_the_triton_interpreter`). GPU (marked ``gpu``):
``python -m pytest tests/plugins/fp8/test_decode_gemm.py -m gpu -v`` on the 1.7B
decode shapes, inside a CUDA graph, and through the linears.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from miles_fp8.gemm import block_scaled_mm_ref
from miles_fp8.quant import quantize_act_ref, quantize_weight_ref
from miles_host.kernels import split_k
from tests.kernel_switches import use_switches
from tests.plugins.triton_interpret import run_interpreted
from tests.plugins.triton_sm90 import compile_sm90

#: (name, N, K) of a Qwen3-1.7B decoder layer's linears
SHAPES_1_7B = [("qkv_proj", 4096, 2048), ("o_proj", 2048, 2048), ("gate_up_proj", 12288, 2048), ("down_proj", 2048, 6144)]


def _activations(m, k, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-3, 2, k)[torch.randperm(k, generator=generator)]
    return (torch.randn(m, k, generator=generator) * spread).to(dtype)


@functools.lru_cache(maxsize=8)
def _weight(n, k, power_of_two, seed):
    """A quantized random weight (cached: the GPU tests reuse the 1.7B shapes across many cases)."""
    return quantize_weight_ref(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05, power_of_two)


def _operands(m, n, k, dtype=torch.bfloat16, power_of_two=False, seed=0):
    x = _activations(m, k, dtype, seed)
    w_q, w_s = _weight(n, k, power_of_two, seed + 1)
    expected = block_scaled_mm_ref(*quantize_act_ref(x, power_of_two), w_q, w_s, torch.float32)
    return x, w_q, w_s, expected


def _assert_matches(got, expected, out_dtype):
    """fp32 out: the reference up to fp32 reordering; low precision: within one rounding step of it."""
    scale = expected.abs().max().item()
    if out_dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * scale)
    else:
        rtol = 2.0**-8 if out_dtype == torch.bfloat16 else 2.0**-11
        torch.testing.assert_close(got.float(), expected, rtol=rtol, atol=1e-6 * scale)


def test_cpu_kernels_under_the_triton_interpreter(request):
    """Quantization bit for bit, GEMM vs reference, split-K reductions (see interpreted_decode_gemm.py)."""
    run_interpreted(Path(__file__).with_name("interpreted_decode_gemm.py"), request)


@pytest.mark.parametrize("m", [1, 32])
def test_gpu_branches_compile_for_sm90(m):
    """The GPU-only code (FMA division, cvt.rn.satfinite, FP8->fp16, wgmma, the split-K semaphore) builds."""
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra installs it)")
    from miles_fp8 import decode_gemm

    config = decode_gemm.small_m_config(m)
    signature = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "y_ptr": "*bf16", "part_ptr": "*fp32",
                 "sem_ptr": "*i32", "M": "i32", "N": "i32", "stride_xm": "i32", "stride_wn": "i32",
                 "stride_wsn": "i32", "stride_ym": "i32"}
    constexprs = dict(BLOCKS_PER_SPLIT=2, POW2=m == 1, SPLIT_K=8, REDUCE_IN_KERNEL=True, EMULATE=False, FP8_MMA=False,
                      BLOCK_M=config.block_m, BLOCK_N=config.block_n, GROUP=128)
    ptx = compile_sm90(decode_gemm._fp8_small_m_kernel, signature, constexprs, config.num_warps, config.num_stages)
    for instruction in ("cvt.rn.satfinite.e4m3x2.f32", "cvt.rn.f16x2.e4m3x2", "fma.rn.f32", "wgmma.mma_async",
                        "cp.async", "atom.global.gpu.acq_rel.add", "ld.global.cg"):
        assert instruction in ptx, instruction
    ptx = compile_sm90(decode_gemm._fp8_small_m_kernel, signature, {**constexprs, "SPLIT_K": 1, "FP8_MMA": True},
                       config.num_warps, config.num_stages)
    assert "atom." not in ptx and "e4m3.e4m3" in ptx  # no semaphore without a split; FP8 wgmma


def test_config_table_and_split_plans():
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra installs it)")
    from miles_fp8.decode_gemm import MAX_M, small_m_config

    for m in range(1, MAX_M + 1):
        config = small_m_config(m)
        assert config.block_m >= m and 128 % config.block_n == 0
    for m in (1, 8, 32, 64):
        for _, n, k in SHAPES_1_7B:
            config = small_m_config(m)
            plan = split_k.plan_split_k(m, n // config.block_n, k // 128, k, sms=132)
            assert plan.split_k * plan.blocks_per_split == k // 128
            assert plan.blocks_per_split >= split_k.MIN_BLOCKS_PER_SPLIT or plan.split_k == 1
            assert plan.split_k * 8 * m <= k or plan.split_k == 1  # partials within the weight bytes
            if m == 1:
                assert plan.num_programs >= 132  # every SM gets work at batch 1
    with pytest.raises(ValueError, match="does not divide"):
        split_k.fixed_split(4, 6, 4)


# ----------------------------------------------------------------------------- GPU

cuda_fp8 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs an FP8 GPU (compute capability >= 8.9)",
)


@pytest.mark.gpu
@cuda_fp8
@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("m", [1, 2, 8, 16, 32, 64])
@pytest.mark.parametrize("name,n,k", SHAPES_1_7B)
def test_gpu_fused_gemm_on_decode_shapes(name, n, k, m, power_of_two, monkeypatch):
    """fp16 products (``--fp8-small-m-mma 0``): the reference's numbers up to the order of fp32 sums."""
    from miles_fp8 import decode_gemm

    use_switches(monkeypatch, fp8_small_m_mma=0)
    x, w_q, w_s, expected = _operands(m, n, k, power_of_two=power_of_two)
    x, w_q, w_s = x.cuda(), w_q.cuda(), w_s.cuda()
    got32 = decode_gemm.fused_act_quant_mm(x, w_q, w_s, power_of_two, out_dtype=torch.float32)
    _assert_matches(got32.cpu(), expected, torch.float32)
    got = decode_gemm.fused_act_quant_mm(x, w_q, w_s, power_of_two)
    _assert_matches(got.cpu(), expected, torch.bfloat16)
    assert torch.equal(got, decode_gemm.fused_act_quant_mm(x, w_q, w_s, power_of_two))  # deterministic
    q, scale = decode_gemm.quantize_rows(x, power_of_two)
    q_ref, scale_ref = quantize_act_ref(x.cpu(), power_of_two)
    assert torch.equal(scale.cpu(), scale_ref) and torch.equal(q.cpu(), q_ref.float())


@pytest.mark.gpu
@cuda_fp8
@pytest.mark.parametrize("m", [1, 8, 32, 64])
@pytest.mark.parametrize("name,n,k", SHAPES_1_7B)
def test_gpu_default_fp8_products_on_decode_shapes(name, n, k, m):
    """The default launch (FP8 tensor-core products): within Hopper's reduced-precision block sums of the reference."""
    from miles_fp8 import decode_gemm

    assert decode_gemm.use_fp8_mma(torch.device("cuda"))
    x, w_q, w_s, expected = _operands(m, n, k)
    got = decode_gemm.fused_act_quant_mm(x.cuda(), w_q.cuda(), w_s.cuda(), out_dtype=torch.float32).cpu()
    error = ((got - expected).norm() / expected.norm()).item()
    assert error < 5e-4, error  # FP8 quantization itself is ~3e-2 of the bf16 product
    again = decode_gemm.fused_act_quant_mm(x.cuda(), w_q.cuda(), w_s.cuda(), out_dtype=torch.float32).cpu()
    assert torch.equal(got, again)  # deterministic


def test_fp8_products_switch(monkeypatch):
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra installs it)")
    from miles_fp8 import decode_gemm

    assert not decode_gemm.use_fp8_mma(torch.device("cpu"))
    with pytest.raises(ValueError, match="--fp8-small-m-mma 'yes'"):
        use_switches(monkeypatch, fp8_small_m_mma="yes")


@pytest.mark.gpu
@cuda_fp8
@pytest.mark.parametrize("reduce", ["kernel", "torch"])
@pytest.mark.parametrize("split", [1, 2, 4, 8, 16])
def test_gpu_split_k_and_fp8_mma_variants(split, reduce, monkeypatch):
    from miles_fp8 import decode_gemm

    use_switches(monkeypatch, split_k_reduce=reduce, fp8_small_m_mma=0)  # the table's fp16 products: exact fp32 sums
    x, w_q, w_s, expected = _operands(8, 2048, 6144)
    x, w_q, w_s = x.cuda(), w_q.cuda(), w_s.cuda()
    got = decode_gemm.fused_act_quant_mm(x, w_q, w_s, out_dtype=torch.float32, split=split)
    _assert_matches(got.cpu(), expected, torch.float32)
    config = decode_gemm.SmallMConfig(16, 64, 4, 4, fp8_mma=True)
    got = decode_gemm.fused_act_quant_mm(x, w_q, w_s, out_dtype=torch.float32, config=config, split=split)
    error = ((got.cpu() - expected).norm() / expected.norm()).item()
    assert error < 5e-4  # Hopper's FP8 MMA sums a 128-deep block at reduced precision
    assert not any(buffer.any() for buffer in split_k._SEMAPHORES.values())


@pytest.mark.gpu
@cuda_fp8
def test_gpu_fused_gemm_in_a_cuda_graph():
    """Captured once, replayed on new inputs: equal to eager launches (same split, same counters reset)."""
    from miles_fp8 import decode_gemm

    x, w_q, w_s, _ = _operands(4, 4096, 2048)
    x, w_q, w_s = x.cuda(), w_q.cuda(), w_s.cuda()
    decode_gemm.fused_act_quant_mm(x, w_q, w_s)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_gemm.fused_act_quant_mm(x, w_q, w_s)
    for seed in range(3):
        x.copy_(_activations(4, 2048, torch.bfloat16, seed=seed + 10).cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, decode_gemm.fused_act_quant_mm(x, w_q, w_s))


@pytest.mark.gpu
@cuda_fp8
@pytest.mark.parametrize("m", [1, 8, 77])
def test_gpu_linears_use_the_fused_kernel_and_stay_unified(m):
    """Fp8Linear (train, bf16 autocast) and Fp8InferenceLinear (rollout) agree bitwise at decode and prefill sizes."""
    from miles_fp8 import gemm

    from .conftest import synced_linear_pair

    train, rollout, named = synced_linear_pair()
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    assert gemm.uses_small_m_kernel(x, rollout.weight_scale_inv, 2048) == (m <= 64)
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        y_train = train(x)
    with torch.no_grad():
        y_rollout = rollout(x)
    assert torch.equal(y_train, y_rollout)
    x_q, x_s = quantize_act_ref(x.cpu())
    expected = block_scaled_mm_ref(x_q, x_s, rollout.weight.cpu(), rollout.weight_scale_inv.cpu()) + named["t.bias"].cpu()
    # two bf16 roundings (GEMM output, then the bias add)
    torch.testing.assert_close(y_rollout.cpu().float(), expected, rtol=2.0**-7, atol=2.0**-8 * expected.abs().max().item())
