"""The aten switch (:mod:`miles_host.kernels.invariant_ops`): registration, fallbacks, autograd.

CPU: the switch itself with a CPU-key registration (CPU tensors then take the
float64 references); ``interpreted_invariant_ops.py`` runs ``F.linear`` and
``mean`` through the Triton kernels under the interpreter. GPU (marked ``gpu``):
``F.linear`` / ``x.mean(-1)`` of bf16 CUDA tensors inside the context are
bitwise row-invariant, the stock kernels come back on exit, gradients are right.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from miles_host.kernels import invariant_ops
from miles_host.kernels.invariant_matmul import invariant_mm
from miles_host.kernels.invariant_ops import CALLS, batch_invariant_aten, is_active, mean_by_sum
from tests.plugins.triton_interpret import run_interpreted

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_BATCHES = (1, 7, 64, 256, 1000, 4096)


def linear_operands(t, k, n, dtype, device="cpu", seed=0, requires_grad=False):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=generator).to(device, dtype)
    w = (torch.randn(n, k, generator=generator) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=generator).to(device, dtype)
    return [v.requires_grad_(requires_grad) for v in (x, w, b)]


def assert_linear_and_mean_rows_invariant(x, w, b, batches):
    """Inside the context: rows of ``F.linear`` and ``mean(-1)`` equal those of the full batch bit for bit."""
    full = (F.linear(x, w), F.linear(x, w, b), x.mean(-1, keepdim=True), x.pow(2).mean(dim=[-1]))
    for t in batches:
        for rows in (slice(0, t), slice(x.shape[0] - t, None)):
            part = x[rows]
            got = (F.linear(part, w), F.linear(part, w, b), part.mean(-1, keepdim=True), part.pow(2).mean(dim=[-1]))
            for g, f in zip(got, full):
                assert torch.equal(g, f[rows]), t
    return full


def gradients_vs_float64(x, w, b, dispatch_key):
    """Gradients of a linear + mean loss inside the context, and the same loss in float64 outside."""
    def loss_fn(x, w, b):
        y = F.linear(x, w, b)
        return (y * torch.linspace(-1, 1, y.shape[1], device=y.device, dtype=y.dtype)).sum() + x.mean(-1).pow(2).sum()

    with batch_invariant_aten(dispatch_key):
        got = torch.autograd.grad(loss_fn(x, w, b), (x, w, b))
    leaves = [v.detach().cpu().double().requires_grad_() for v in (x, w, b)]
    expected = torch.autograd.grad(loss_fn(*leaves), leaves)
    return got, expected


def test_cpu_kernels_under_the_triton_interpreter(request):
    """F.linear / mean through the Triton kernels, CPU-key registration (see interpreted_invariant_ops.py)."""
    run_interpreted(Path(__file__).with_name("interpreted_invariant_ops.py"), request)


def test_switch_registers_nests_and_restores():
    x, w, b = linear_operands(3, 8, 5, torch.float32)
    before = CALLS.copy()
    assert not is_active()
    with batch_invariant_aten("CPU"):
        assert is_active()
        F.linear(x, w, b)
        with batch_invariant_aten("CPU"):  # nested: a no-op
            x @ w.t()
        assert is_active()
        x.mean(-1)
        assert (CALLS - before) == {"addmm": 1, "mm": 1, "mean.dim": 1}
    assert not is_active()
    after = CALLS.copy()
    F.linear(x, w, b), x @ w.t(), x.mean(-1)
    assert CALLS == after  # stock kernels again
    with pytest.raises(KeyError), batch_invariant_aten("CPU"):
        raise KeyError("boom")
    assert not is_active() and invariant_ops._LIBRARY is None
    F.linear(x, w)
    assert CALLS == after


def test_overrides_keep_torch_semantics():
    """addmm's beta/alpha/2-D self, means over other dims, dtypes: as the stock ops (to rounding)."""
    x, w, b = linear_operands(6, 8, 5, torch.float32)
    c = torch.randn(6, 5)
    c[0, 0] = float("nan")
    cases = [
        lambda: torch.addmm(b, x, w.t()), lambda: torch.addmm(b, x, w.t(), beta=0.5, alpha=2.0),
        lambda: torch.addmm(c[:1], x, w.t()), lambda: torch.addmm(c, x, w.t(), beta=0.0, alpha=-1.0),
        lambda: torch.addmm(c[:, :1], x, w.t(), beta=3.0), lambda: x.double() @ w.double().t(),
        lambda: x.mean(-1), lambda: x.mean(0, keepdim=True), lambda: x.mean([0, 1]),
        lambda: x.reshape(2, 3, 8).mean([0, 2]), lambda: x.bfloat16().mean(0, dtype=torch.float32),
        lambda: x.bfloat16().mean(-1), lambda: x.double().mean(-1), lambda: torch.tensor(2.0).mean(-1),
    ]
    expected = [case() for case in cases]
    with batch_invariant_aten("CPU"):
        got = [case() for case in cases]
        with pytest.raises(RuntimeError, match="could not infer output dtype"):
            torch.arange(6).reshape(2, 3).mean(0)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, equal_nan=True, rtol=1e-6 if e.dtype != torch.bfloat16 else 2**-8, atol=1e-6)
    assert torch.equal(mean_by_sum(x, None), x.mean().reshape(()))


def test_autograd_through_the_switch_on_cpu():
    got, expected = gradients_vs_float64(*linear_operands(9, 16, 7, torch.float32, requires_grad=True), "CPU")
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@requires_cuda
def test_gpu_linear_and_mean_are_row_invariant_inside():
    x, w, b = linear_operands(max(GPU_BATCHES), 1024, 4096, torch.bfloat16, device="cuda")
    with batch_invariant_aten():
        assert is_active()
        before = CALLS.copy()
        full = assert_linear_and_mean_rows_invariant(x, w, b, GPU_BATCHES)
        assert (CALLS - before)["addmm"] > 0 and (CALLS - before)["mm"] > 0 and (CALLS - before)["mean.dim"] > 0
        assert torch.equal(full[1], invariant_mm(x, w.t(), b))
        seq = x[:4032].reshape(63, 64, 1024)  # a [batch, seq, hidden] input: flattened by F.linear
        assert torch.equal(F.linear(seq, w, b).reshape(-1, 4096), full[1][:4032])
        assert torch.equal(seq.mean(-1, keepdim=True).reshape(-1, 1), full[2][:4032])


@pytest.mark.gpu
@requires_cuda
def test_gpu_stock_kernels_after_exit():
    x, w, b = linear_operands(333, 1024, 4096, torch.bfloat16, device="cuda")
    with batch_invariant_aten():
        inside = F.linear(x, w, b)
    assert not is_active()
    after = CALLS.copy()
    outside = F.linear(x, w, b)
    x.mean(-1)
    assert CALLS == after  # no override ran: cuBLAS and the stock reduction
    torch.testing.assert_close(outside.float(), inside.float(), rtol=2**-7, atol=1e-2)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_autograd_through_the_switch(dtype):
    """Backward runs under the context too (mm for both input and weight gradients): right vs float64."""
    operands = linear_operands(300, 1024, 2048, dtype, device="cuda", requires_grad=True)
    before = CALLS["mm"]
    got, expected = gradients_vs_float64(*operands, "CUDA")
    assert CALLS["mm"] - before >= 2
    rtol = 1e-5 if dtype == torch.float32 else 2**-7
    for g, e in zip(got, expected):
        assert g.dtype == dtype
        torch.testing.assert_close(g.cpu().double(), e, rtol=rtol, atol=rtol * e.abs().max().item())
