"""Batch-invariant row mean and token log-probs (:mod:`miles_host.kernels.invariant_reduce`) vs float64.

CPU: ``interpreted_invariant_reduce.py`` runs the Triton kernels under the
interpreter in a subprocess; the references and argument checks run here.
GPU (marked ``gpu``): accuracy and bitwise row invariance on Qwen3 sizes
(hidden 1024-3072, vocabulary 151936).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_host.kernels.invariant_reduce import (
    invariant_log_probs, invariant_log_probs_reference, invariant_row_mean, invariant_row_mean_reference,
)
from tests.plugins.triton_interpret import run_interpreted
from tests.plugins.triton_sm90 import compile_sm90

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_BATCHES = (1, 7, 64, 256, 1000, 4096)
QWEN_VOCAB = 151936


def rows(n, length, dtype, seed=0, device="cpu", scale=3.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(n, length, generator=generator) * scale + 0.5).to(device, dtype)


def assert_mean_close(got, x, keepdim=False, dtype=None):
    expected = x.double().sum(-1, keepdim=keepdim) / x.shape[-1]
    assert got.dtype == (dtype or x.dtype) and got.shape == expected.shape
    rtol = {torch.float32: 1e-6, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-8}[got.dtype]
    torch.testing.assert_close(got.double(), expected, rtol=rtol, atol=1e-6 * x.double().abs().max().item())


def logits_and_targets(t, vocab, dtype, seed=0, device="cpu"):
    """Logits of varied scale per row, one row with ``-inf`` stretches (a masked vocabulary)."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 1.3, t).unsqueeze(1)
    logits = torch.randn(t, vocab, generator=generator) * scale
    logits[t // 2, : vocab // 3] = float("-inf")
    targets = torch.randint(0, vocab, (t,), generator=generator)
    targets[t // 2] = vocab - 1
    return logits.to(device, dtype), targets.to(device)


def assert_log_probs_close(logits, targets, **options):
    got, entropy = invariant_log_probs(logits, targets, return_entropy=True, **options)
    expected, expected_entropy = invariant_log_probs_reference(logits, targets, return_entropy=True, **options)
    assert got.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(entropy, expected_entropy, rtol=1e-5, atol=2e-5)
    only, none = invariant_log_probs(logits, targets, **options)
    assert none is None and torch.equal(only, got)
    return got, entropy


def assert_log_probs_invariant(logits, targets, batches, **options):
    full = invariant_log_probs(logits, targets, return_entropy=True, **options)
    perm = torch.randperm(logits.shape[0], generator=torch.Generator().manual_seed(1)).to(logits.device)
    for t in batches:
        for index in (torch.arange(t, device=logits.device), perm[:t]):
            sub = invariant_log_probs(logits[index], targets[index], return_entropy=True, **options)
            assert torch.equal(sub[0], full[0][index]) and torch.equal(sub[1], full[1][index]), t


def test_cpu_kernels_under_the_triton_interpreter(request):
    """Accuracy and bitwise per-row invariance (see interpreted_invariant_reduce.py)."""
    run_interpreted(Path(__file__).with_name("interpreted_invariant_reduce.py"), request)


def test_references_and_argument_checks():
    x = rows(5, 33, torch.float32)
    assert_mean_close(invariant_row_mean(x, [-1], keepdim=True), x, keepdim=True)
    assert invariant_row_mean(x.bfloat16(), 1, dtype=torch.float32).dtype == torch.float32
    for dim in (0, [0, 1], None, [-2]):
        with pytest.raises(NotImplementedError, match="last dim"):
            invariant_row_mean(x, dim)
    with pytest.raises(NotImplementedError, match="float64"):
        invariant_row_mean(x.double(), -1)
    with pytest.raises(NotImplementedError):
        invariant_row_mean_reference(x, 0)
    logits, targets = logits_and_targets(4, 50, torch.float32)
    assert_log_probs_close(logits, targets, temperature=0.7, logit_softcap=20.0)
    with pytest.raises(ValueError, match=r"targets \[T\]"):
        invariant_log_probs(logits, targets[:3])
    with pytest.raises(ValueError, match="integer targets"):
        invariant_log_probs(logits, targets.float())


@pytest.mark.parametrize("softcap", [False, True])
def test_gpu_branches_compile_for_sm90(softcap):
    """The GPU-only code (runtime-length loops, libdevice tanh, div.rn, rtne stores) builds for sm_90."""
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra installs it)")
    from miles_host.kernels import _invariant_reduce_triton as kernels

    block, warps = kernels.block_for(QWEN_VOCAB)
    signature = {"Logits": "*bf16", "Targets": "*i64", "LogProbs": "*fp32", "Entropy": "*fp32", "V": "i32",
                 "stride_row": "i32", "stride_v": "constexpr", "temperature": "fp32", "softcap": "fp32"}
    constexprs = dict(stride_v=1, HAS_SOFTCAP=softcap, WITH_ENTROPY=True, EMULATE=False, EMULATED_CHUNKS=0, BLOCK=block)
    ptx = compile_sm90(kernels._log_probs_kernel, signature, constexprs, warps, 1, unaligned=("V",))
    assert "div.rn.f32" in ptx and ("tanh" in ptx) == softcap
    signature = {"X": "*bf16", "Out": "*bf16", "L": "i32", "stride_row": "i32"}
    ptx = compile_sm90(kernels._row_mean_kernel, signature, dict(EMULATE=False, EMULATED_CHUNKS=0, BLOCK=1024), 4, 1,
                       unaligned=("L",))
    assert "cvt.rn.bf16.f32" in ptx and "div.rn.f32" in ptx


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("length", [1024, 2048, 3072, 5000])
def test_gpu_row_mean_accurate_and_invariant(length, dtype):
    x = rows(max(GPU_BATCHES) + 5, length, dtype, device="cuda")
    full = invariant_row_mean(x, -1, keepdim=True)
    assert_mean_close(full, x, keepdim=True)
    assert_mean_close(invariant_row_mean(x, -1, dtype=torch.float32), x, dtype=torch.float32)
    for t in GPU_BATCHES:
        assert torch.equal(invariant_row_mean(x[:t], -1, keepdim=True), full[:t])
        assert torch.equal(invariant_row_mean(x[5 : 5 + t], -1, keepdim=True), full[5 : 5 + t])
    three_d = x[:4096].reshape(64, 64, length)
    assert torch.equal(invariant_row_mean(three_d, 2).reshape(-1), full[:4096, 0])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_log_probs_on_the_qwen_vocabulary(dtype):
    logits, targets = logits_and_targets(1000, QWEN_VOCAB, dtype, device="cuda")
    for options in (dict(), dict(temperature=0.6), dict(temperature=1.3, logit_softcap=30.0)):
        assert_log_probs_close(logits, targets, **options)
        assert_log_probs_invariant(logits, targets, (1, 7, 64, 256, 1000), **options)


@pytest.mark.gpu
@requires_cuda
def test_gpu_log_probs_invariant_up_to_4096_rows():
    logits, targets = logits_and_targets(4096, QWEN_VOCAB, torch.bfloat16, device="cuda")
    assert_log_probs_invariant(logits, targets, GPU_BATCHES, temperature=0.8)
