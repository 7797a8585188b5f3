"""GPU kernels against the CPU reference: Triton quantize (bitwise), Triton / cuBLAS GEMM (tight).

Run on an FP8 GPU (compute capability >= 8.9) with triton installed:
``python -m pytest tests/plugins/fp8/test_gpu.py -m gpu -v``.
"""

from __future__ import annotations

import pytest
import torch

from miles_fp8.quant import quantize_act_ref, quantize_weight_ref
from miles_fp8.gemm import block_scaled_mm_ref
from tests.kernel_switches import use_switches

pytestmark = pytest.mark.gpu


def _fp8_gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if torch.cuda.get_device_capability() < (8, 9):
        return "needs an FP8 GPU (compute capability >= 8.9)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "needs triton"
    return None


_REASON = _fp8_gpu_reason()
if _REASON:
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason=_REASON)]


def _data(*shape, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3, 2, shape[-1])[torch.randperm(shape[-1], generator=generator)]
    return (torch.randn(*shape, generator=generator) * scale).to(dtype)


def _same_bits(a, b):
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 128), (37, 384), (4096, 1024), (3, 5, 256)])
def test_triton_quantize_act_is_bitwise_the_reference(shape, dtype, power_of_two):
    from miles_fp8 import triton_kernels

    x = _data(*shape, dtype=dtype)
    x[..., :128].view(-1, 128)[0] = 0
    q, scale = triton_kernels.quantize_act(x.cuda(), power_of_two)
    q_ref, scale_ref = quantize_act_ref(x, power_of_two)
    assert _same_bits(q, q_ref) and torch.equal(scale.cpu(), scale_ref)


@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(128, 128), (384, 1024), (4, 256, 128)])
def test_triton_quantize_weight_is_bitwise_the_reference(shape, dtype, power_of_two):
    from miles_fp8 import triton_kernels

    w = _data(*shape, dtype=dtype, seed=1)
    q, scale = triton_kernels.quantize_weight(w.cuda(), power_of_two)
    q_ref, scale_ref = quantize_weight_ref(w, power_of_two)
    assert _same_bits(q, q_ref) and torch.equal(scale.cpu(), scale_ref)


def test_triton_quantize_non_contiguous_rows():
    from miles_fp8 import triton_kernels

    x = _data(64, 512)[:, 128:384]
    q, scale = triton_kernels.quantize_act(x.cuda())
    q_ref, scale_ref = quantize_act_ref(x)
    assert _same_bits(q, q_ref) and torch.equal(scale.cpu(), scale_ref)


def _operands(m, n, k, b_rows, transpose_b=False, seed=0):
    a_q, a_s = quantize_act_ref(_data(m, k, seed=seed))
    if b_rows == 128:
        b_q, b_s = quantize_weight_ref(torch.randn(k, n) if transpose_b else torch.randn(n, k))
        if transpose_b:
            b_q, b_s = b_q.t(), b_s.t()
    else:
        b_q, b_s = quantize_act_ref(torch.randn(n, k))
    return a_q, a_s, b_q, b_s


def _relative_error(got, expected):
    return ((got.float().cpu() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b_rows", [128, 1])
@pytest.mark.parametrize("m", [1, 17, 64, 300, 1024])
def test_triton_gemm_matches_reference(m, b_rows, out_dtype):
    from miles_fp8 import triton_kernels

    a_q, a_s, b_q, b_s = _operands(m, 768, 1024, b_rows)
    expected = block_scaled_mm_ref(a_q, a_s, b_q, b_s, torch.float32)
    got = triton_kernels.block_scaled_mm(a_q.cuda(), a_s.cuda(), b_q.cuda(), b_s.cuda(), out_dtype)
    assert got.dtype == out_dtype
    # Hopper FP8 MMAs accumulate a 128-deep block with ~14 mantissa bits before the fp32 promotion
    assert _relative_error(got, expected) < (5e-4 if out_dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_gemm_transposed_weight_blocks_for_dgrad(backend, monkeypatch):
    from miles_fp8 import gemm

    use_switches(monkeypatch, fp8_gemm=backend)
    a_q, a_s, b_q, b_s = _operands(200, 512, 384, 128, transpose_b=True)
    expected = block_scaled_mm_ref(a_q, a_s, b_q, b_s, torch.float32)
    got = gemm.block_scaled_mm(a_q.cuda(), a_s.cuda(), b_q.cuda(), b_s.cuda(), torch.float32)
    assert _relative_error(got, expected) < 5e-4


@pytest.mark.parametrize("m", [1, 100, 2048])
def test_cublas_scaled_mm_path_matches_reference(m):
    from miles_fp8 import gemm

    if not gemm.scaled_mm_usable(torch.device("cuda")):
        pytest.skip("cuBLAS block-scaled _scaled_mm unusable here (Triton GEMM is used instead)")
    a_q, a_s, b_q, b_s = _operands(m, 1024, 2048, 128)
    expected = block_scaled_mm_ref(a_q, a_s, b_q, b_s, torch.float32)
    got = gemm._scaled_mm_cublas(a_q.cuda(), a_s.cuda(), b_q.cuda(), b_s.cuda(), torch.bfloat16)
    assert _relative_error(got, expected) < 4e-3


def test_fp8_linear_on_gpu_matches_cpu_emulation():
    from miles_fp8.linear import Fp8Linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(512, 384, bias=True)
    x = torch.randn(300, 512)
    dy = torch.randn(300, 384)
    results = []
    for device in ("cpu", "cuda"):
        module = Fp8Linear.from_linear(torch.nn.Linear(512, 384).to(device), name="t")
        with torch.no_grad():
            module.weight.copy_(linear.weight)
            module.bias.copy_(linear.bias)
        x_d = x.detach().clone().to(device).requires_grad_(True)
        y = module(x_d)
        (y * dy.to(device)).sum().backward()
        results.append((y.detach().cpu(), x_d.grad.cpu(), module.weight.grad.cpu()))
    for cpu, gpu in zip(*results):
        assert _relative_error(gpu, cpu) < 1e-3


def test_unified_layer_on_gpu_train_under_autocast_equals_rollout_bf16():
    """Per layer: Fp8Linear (fp32 master, bf16 autocast) and Fp8InferenceLinear (synced weights) agree bitwise."""
    from .conftest import synced_linear_pair

    train, rollout, named = synced_linear_pair()
    x = torch.randn(77, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        y_train = train(x)
    with torch.no_grad():
        y_rollout = rollout(x)
    assert y_train.dtype == y_rollout.dtype == torch.bfloat16
    assert torch.equal(y_train, y_rollout)
