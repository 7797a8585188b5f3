"""The batch-invariant GEMM (:mod:`miles_host.kernels.invariant_matmul`) against its float64 reference.

CPU: ``interpreted_invariant_matmul.py`` runs the Triton kernel under the
interpreter in a subprocess (accuracy, bitwise row invariance, every config);
the config table and the sm_90 build (every M tier is wgmma / FMA) are checked
here. GPU (marked ``gpu``): ``python -m pytest tests/kernels -m gpu -v`` on the
Qwen3-0.6B shapes: accuracy, bitwise invariance across M and across every
alternative config of :data:`~miles_host.kernels.invariant_matmul.M_TIERS`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from miles_host.kernels import invariant_matmul
from miles_host.kernels.invariant_matmul import (
    M_TIERS, MatmulConfig, alternatives, invariant_mm, invariant_mm_reference, matmul_config,
)
from tests.plugins.triton_interpret import run_interpreted
from tests.plugins.triton_sm90 import compile_sm90

#: (N, K) of Qwen3-0.6B's linears: qkv, o, gate_up, down, lm_head
QWEN3_0_6B_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]
GPU_MS = (1, 7, 64, 256, 1000, 4096)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def operands(m, n, k, dtype, seed=0, device="cpu", bias=False):
    """``a [m, k]``, ``b = weight.t()`` (a transposed view of a ``[n, k]`` weight), optional ``bias [n]``."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=generator).to(device, dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=generator).to(device, dtype) if bias else None
    return a, weight.t(), b


def assert_close_to_reference(got, a, b, bias=None):
    """Within the output dtype's rounding (rtol) of the float64 product, plus fp32 accumulation error (atol)."""
    expected = invariant_mm_reference(a, b, bias, torch.float64)
    scale = expected.abs().max().item()
    rtol = {torch.float32: 1e-5, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[got.dtype]
    torch.testing.assert_close(got.double(), expected, rtol=rtol, atol=1e-5 * scale)


def assert_rows_invariant(a, b, bias=None, ms=(1, 3, 17, 64, 130), seed=1):
    """Rows of any sub-batch (consecutive, shuffled, offset) equal the full batch's rows bit for bit."""
    full = invariant_mm(a, b, bias)
    generator = torch.Generator().manual_seed(seed)
    perm = torch.randperm(a.shape[0], generator=generator).to(a.device)
    for m in ms:
        assert torch.equal(invariant_mm(a[:m], b, bias), full[:m]), m
        assert torch.equal(invariant_mm(a[perm[:m]], b, bias), full[perm[:m]]), m
        assert torch.equal(invariant_mm(a[-m:], b, bias), full[-m:]), m
    for i in (0, a.shape[0] // 2, a.shape[0] - 1):
        assert torch.equal(invariant_mm(a[i : i + 1], b, bias), full[i : i + 1]), i
    return full


def test_cpu_kernel_under_the_triton_interpreter(request):
    """Accuracy, bitwise row invariance, every config (see interpreted_invariant_matmul.py)."""
    run_interpreted(Path(__file__).with_name("interpreted_invariant_matmul.py"), request)


def test_config_tiers_share_block_k_and_mma_family():
    for dtype, tiers in M_TIERS.items():
        configs = alternatives(dtype)
        assert len({c.block_k for c in configs}) == 1, dtype
        assert all(c.block_m >= 64 and c.num_warps % 4 == 0 for c in configs), dtype
        bounds = [bound for bound, _ in tiers]
        assert bounds[-1] is None and bounds[:-1] == sorted(bounds[:-1])
        for m in (1, 64, 512, 513, 2048, 2049, 16384):
            assert matmul_config(m, 1024, 1024, dtype) in configs
    assert matmul_config(1, 4096, 1024, torch.bfloat16).block_m == 64  # decode: many small tiles
    assert matmul_config(8192, 4096, 1024, torch.bfloat16) == MatmulConfig(128, 256, 64, 8, 3)
    with pytest.raises(ValueError, match="float64"):
        matmul_config(1, 8, 8, torch.float64)


def test_single_config_fallback(monkeypatch):
    monkeypatch.setattr(invariant_matmul, "SINGLE_CONFIG", True)
    for dtype in M_TIERS:
        assert {matmul_config(m, 64, 64, dtype) for m in (1, 100, 5000)} == {invariant_matmul.SINGLE_CONFIGS[dtype]}
        assert invariant_matmul.SINGLE_CONFIGS[dtype] in alternatives(dtype)


def test_cpu_without_the_interpreter_takes_the_float64_reference():
    a, b, bias = operands(5, 24, 40, torch.bfloat16, bias=True)
    got = invariant_mm(a, b, bias)
    assert got.dtype == torch.bfloat16 and torch.equal(got, invariant_mm_reference(a, b, bias))
    assert invariant_mm(a, b, out_dtype=torch.float32).dtype == torch.float32
    with pytest.raises(ValueError, match="one dtype"):
        invariant_mm(a, b.float())
    with pytest.raises(ValueError, match=r"\[M, K\] x \[K, N\]"):
        invariant_mm(a, b[:-1])
    with pytest.raises(ValueError, match="bias"):
        invariant_mm(a, b, bias[:-1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_tier_compiles_to_one_mma_family_for_sm90(dtype):
    """bf16: wgmma m64nXk16 for every tier (X = block_n / warpgroups); fp32: FMA, never TF32."""
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra installs it)")
    from miles_host.kernels import _invariant_matmul_triton

    pointer = {torch.bfloat16: "*bf16", torch.float32: "*fp32"}[dtype]
    # every parameter in the kernel's order (compile_sm90 gives divisibility by position);
    # b = weight.t(): K contiguous in both operands (strides of 1 are specialized), as in F.linear
    signature = {"A": pointer, "B": pointer, "Bias": pointer, "C": pointer, "M": "i32", "N": "i32", "K": "i32",
                 "stride_am": "i32", "stride_ak": "constexpr", "stride_bk": "constexpr", "stride_bn": "i32",
                 "stride_cm": "i32", "stride_cn": "constexpr"}
    ks = set()
    for config in alternatives(dtype):
        constexprs = dict(stride_ak=1, stride_bk=1, stride_cn=1, HAS_BIAS=True, EVEN_K=False, EMULATE=False,
                          EMULATED_K_BLOCKS=0, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                          BLOCK_K=config.block_k, GROUP_M=config.group_m)
        ptx = compile_sm90(_invariant_matmul_triton._invariant_mm_kernel, signature, constexprs,
                           config.num_warps, config.num_stages)
        mmas = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k(\d+)\.f32\.bf16\.bf16", ptx))
        assert "tf32" not in ptx and "mma.sync" not in ptx
        assert "cp.async" in ptx and "st.global.v4.b32" in ptx, config  # pipelined 16-byte loads, vector stores
        if dtype == torch.bfloat16:
            assert mmas, config
            ks |= mmas
        else:
            assert not mmas and "fma.rn.f32" in ptx, config
    assert len(ks) <= 1


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("n,k", QWEN3_0_6B_SHAPES)
def test_gpu_matches_the_float64_reference(n, k):
    for m in (1, 300, 4096):
        a, b, bias = operands(m, n, k, torch.bfloat16, device="cuda", bias=True)
        assert_close_to_reference(invariant_mm(a, b), a, b)
        assert_close_to_reference(invariant_mm(a, b, bias), a, b, bias)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("n,k", QWEN3_0_6B_SHAPES)
def test_gpu_rows_are_bitwise_invariant_across_batch_sizes(n, k):
    a, b, bias = operands(max(GPU_MS) + 3, n, k, torch.bfloat16, device="cuda", bias=True)
    assert_rows_invariant(a, b, ms=GPU_MS)
    assert_rows_invariant(a[:1200], b, bias, ms=(1, 7, 64, 256, 1000))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("n,k", QWEN3_0_6B_SHAPES)
def test_gpu_every_alternative_config_is_bitwise_identical(n, k):
    """The M tiers must not change a bit: if this fails, set ``invariant_matmul.SINGLE_CONFIG = True``."""
    a, b, bias = operands(1000, n, k, torch.bfloat16, device="cuda", bias=True)
    for with_bias in (None, bias):
        outputs = {config: invariant_mm(a, b, with_bias, config=config) for config in alternatives(torch.bfloat16)}
        first = next(iter(outputs.values()))
        for config, out in outputs.items():
            assert torch.equal(out, first), (config, (out != first).sum().item())


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_other_dtypes(dtype):
    a, b, bias = operands(1100, 1024, 1000, dtype, device="cuda", bias=True)  # K not a multiple of block_k
    assert_close_to_reference(invariant_mm(a, b, bias), a, b, bias)
    full = assert_rows_invariant(a, b, bias, ms=(1, 7, 64, 256, 1000))
    for config in alternatives(dtype):
        assert torch.equal(invariant_mm(a, b, bias, config=config), full), config


@pytest.mark.gpu
@requires_cuda
def test_gpu_strided_operands():
    """Other layouts (contiguous ``b``, column-major ``a``: the backward's operands) are right; a row
    slice of a wider buffer (same layout, other row stride and base) gives the same bits."""
    a, b, _ = operands(777, 4096, 1024, torch.bfloat16, device="cuda")
    expected = invariant_mm(a, b)
    assert_close_to_reference(invariant_mm(a, b.contiguous()), a, b)
    assert_close_to_reference(invariant_mm(a.t().contiguous().t(), b), a, b)
    wide = torch.zeros(777, 3000, device="cuda", dtype=torch.bfloat16)
    wide[:, 1000:2024] = a
    assert torch.equal(invariant_mm(wide[:, 1000:2024], b), expected)


@pytest.mark.gpu
@requires_cuda
def test_gpu_lm_head_weight_gradient_strides():
    """``grad_logits.t() @ hidden`` of a 16k-token lm head: K steps of 151936 elements pass 2^31 (int64 offsets)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    grad_logits = torch.randn(16384, 151936, device="cuda", dtype=torch.bfloat16, generator=generator)
    hidden = torch.randn(16384, 1024, device="cuda", dtype=torch.bfloat16, generator=generator)
    a = grad_logits.t()[-300:]  # the last vocabulary rows: [300, 16384], strides (1, 151936)
    assert_close_to_reference(invariant_mm(a, hidden), a, hidden)
