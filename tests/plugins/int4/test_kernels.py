"""The packed INT4 GEMMs (torch's CPU kernel here; on the GPU machine the Triton ``halves`` kernel
and torch's tinygemm) against their float reference."""

from __future__ import annotations

import pytest
import torch

from miles_int4.kernels import int4_mm, kernel_supports, pack_for_kernel, reference_mm
from miles_int4.quant import quantize


def _weights(out_features, in_features, group_size, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=generator) * 0.05
    q, scale = quantize(w, group_size)
    return q.to(device), scale.to(device)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_cpu_int4_mm_matches_float_reference(group_size, rows):
    q, scale = _weights(96, 384, group_size)
    x = torch.randn(rows, 384, generator=torch.Generator().manual_seed(rows))
    packed = pack_for_kernel(q, scale, torch.float32)
    expected = reference_mm(x.double(), q, scale)
    torch.testing.assert_close(int4_mm(x, packed).double(), expected, rtol=1e-5, atol=1e-5)
    x_bf16 = x.to(torch.bfloat16)
    got = int4_mm(x_bf16, packed)  # scales follow the activation dtype
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), reference_mm(x_bf16.double(), q, scale), rtol=2e-2, atol=2e-2)


def test_leading_dims_and_kernel_shape_limits():
    q, scale = _weights(32, 128, 32)
    x = torch.randn(2, 3, 128)
    packed = pack_for_kernel(q, scale, torch.float32)
    assert int4_mm(x, packed).shape == (2, 3, 32)
    assert kernel_supports(32, 128, torch.device("cpu"))
    assert not kernel_supports(24, 128, torch.device("cpu"))  # the CPU kernel needs N % 16 == 0


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("layout", ["halves", "tinygemm"])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 16, 64, 65])
def test_cuda_int4_mm_matches_float_reference(group_size, rows, layout):
    q, scale = _weights(1024, 2048, group_size, device="cuda")
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    assert kernel_supports(1024, 2048, torch.device("cuda"), layout)
    got = int4_mm(x, pack_for_kernel(q, scale, torch.bfloat16, layout))
    expected = reference_mm(x.float(), q, scale)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.mark.gpu
@cuda
def test_cuda_rollout_model_packed_vs_qat(tiny_checkpoints):
    from miles_host.models import load_pretrained
    from miles_int4.plugin import miles_register_precisions
    from miles_int4.rollout import Int4Experts, Int4Linear, refresh_int4_weights
    from tests.plugins.int4.conftest import Flags

    int4 = miles_register_precisions()[0]
    path = tiny_checkpoints["qwen3_moe"]
    flags = Flags(32, "all", rollout_gemm="auto")
    train = int4.prepare_train_model(load_pretrained(path, dtype=torch.float32, device="cuda"), flags)
    rollout = int4.prepare_rollout_model(load_pretrained(path, dtype=torch.bfloat16, device="cuda"), flags)
    modules = [m for m in rollout.modules() if isinstance(m, (Int4Linear, Int4Experts))]
    assert modules and all(m.use_kernel for m in modules)
    ids = torch.randint(2, 96, (2, 12), device="cuda")
    # the same bf16 model with the dequantize-then-F.linear path: only the GEMM differs
    dequant = int4.prepare_rollout_model(
        load_pretrained(path, dtype=torch.bfloat16, device="cuda"), Flags(32, "all", rollout_gemm="dequant")
    )
    with torch.no_grad():
        got = rollout(ids).float()
        expected = dequant(ids).float()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        qat = train(ids).float()
    print(f"max |packed - dequant| {(got - expected).abs().max():.4f}, max |packed - QAT under autocast| "
          f"{(got - qat).abs().max():.4f}, max |logit| {expected.abs().max():.4f}")
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    assert (got - qat).abs().max() < 0.1 * qat.abs().max()
    # dequant path on CUDA: bit-identical to the QAT forward at the same dtype
    exact = int4.prepare_rollout_model(load_pretrained(path, dtype=torch.float32, device="cuda"), Flags(32, "all", rollout_gemm="dequant"))
    with torch.no_grad():
        assert torch.equal(exact(ids), train(ids))
    # in-place refresh keeps kernel tensor addresses (what captured CUDA graphs read)
    from miles_host.rollout.weights import copy_named_tensors
    from miles_int4.quant import compress

    name, linear = next((n, m) for n, m in rollout.named_modules() if isinstance(m, Int4Linear))
    address = linear._kernel_copies["weight"][0].weight.data_ptr()
    rolled = torch.roll(train.get_submodule(name).weight.detach(), 1, 0)
    copy_named_tensors(rollout, compress(f"{name}.weight", rolled, 32))
    assert refresh_int4_weights(rollout) == len(modules)
    assert linear._kernel_copies["weight"][0].weight.data_ptr() == address
