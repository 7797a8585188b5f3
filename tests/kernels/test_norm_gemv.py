"""The residual add and RMSNorm inside the one-token GEMV (:mod:`miles_host.kernels.norm_gemv`)
against the RMSNorm reference and a float64 GEMV: under Triton's interpreter on CPU
(``interpreted_norm_gemv.py``) and on a GPU at the Qwen3-30B-A3B qkv shape, through the table's
launch and inside a CUDA graph."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.kernel_switches import use_switches
from tests.kernels.test_small_m_gemm import assert_within_rounding
from tests.plugins.triton_interpret import run_interpreted


def pending_norm(k: int, residual: bool, unit_offset: bool, device: str = "cpu", seed: int = 0):
    from miles_host.kernels.norm_gemv import PendingNorm

    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(1, k, generator=generator).to(torch.bfloat16)
    r = (torch.randn(1, k, generator=generator) * 4).to(torch.bfloat16) if residual else None
    g = (torch.rand(k, generator=generator) + 0.5).to(torch.bfloat16)
    return PendingNorm(h.to(device), r.to(device) if r is not None else None, g.to(device), 1e-6, unit_offset)


def check_norm_gemv(norm_gemv, pending, w, launch=None) -> None:
    """The new residual equal to the eager add's; the normalized row within one bf16 step of the
    RMSNorm reference's (the sum of squares in another order); the output within rounding of the
    float64 GEMV of that row."""
    from miles_host.kernels.rmsnorm import rmsnorm_reference

    y, residual, x = norm_gemv(pending, w, write_x=True, launch=launch)
    x_ref, residual_ref = rmsnorm_reference(pending.h_TH, pending.weight_H, pending.eps, pending.unit_offset,
                                            pending.residual_TH)
    assert torch.equal(residual, pending.h_TH if residual_ref is None else residual_ref)
    torch.testing.assert_close(x.float(), x_ref.float(), rtol=2.0**-7, atol=0)
    assert (x != x_ref).float().mean() < 0.01
    assert_within_rounding(y, (x.double() @ w.double().T).to(y.dtype))


def test_cpu_kernel_under_the_triton_interpreter(request):
    run_interpreted(Path(__file__).with_name("interpreted_norm_gemv.py"), request)


def test_without_the_kernel_the_norm_then_the_linear():
    """On CPU (no Triton): the RMSNorm and the module, the residual passed through."""
    from miles_host.kernels.norm_gemv import normed_linear
    from miles_host.kernels.rmsnorm import rmsnorm_reference

    pending = pending_norm(64, residual=True, unit_offset=False)
    linear = torch.nn.Linear(64, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        y, residual = normed_linear(linear, pending)
        x_ref, residual_ref = rmsnorm_reference(pending.h_TH, pending.weight_H, 1e-6, False, pending.residual_TH)
        assert torch.equal(residual, residual_ref) and torch.equal(y, linear(x_ref))
    first = pending_norm(64, residual=False, unit_offset=False)
    with torch.no_grad():
        assert normed_linear(linear, first)[1] is first.h_TH


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_gpu_qkv_shape_through_the_table_launch(residual, unit_offset, monkeypatch):
    from miles_host.kernels.norm_gemv import norm_gemv, takes
    from tests.kernels.test_small_m_gemm import operands

    _, w = operands(1, 5120, 2048, device="cuda")
    pending = pending_norm(2048, residual, unit_offset, device="cuda")
    with torch.no_grad():  # the decode paths take it without autograd only
        use_switches(monkeypatch, decode_norms="separate")
        assert not takes(pending, w)
        use_switches(monkeypatch, decode_norms="fused")
        assert takes(pending, w)
    check_norm_gemv(norm_gemv, pending, w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_in_a_cuda_graph_equals_the_norm_then_the_gemv():
    """Replayed with new rows: the fused launch's output equals the RMSNorm kernel then the table's
    GEMV wherever the two normalized rows agree (nearly all rows: checked above)."""
    from miles_host.kernels.norm_gemv import PendingNorm, norm_gemv
    from miles_host.kernels.small_m_gemm import small_m_linear
    from tests.kernels.test_small_m_gemm import operands

    _, w = operands(1, 5120, 2048, device="cuda")
    static = pending_norm(2048, True, False, device="cuda")
    norm_gemv(static, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, residual, x = norm_gemv(static, w, write_x=True)
    for seed in range(3):
        fresh = pending_norm(2048, True, False, device="cuda", seed=seed + 1)
        static.h_TH.copy_(fresh.h_TH)
        static.residual_TH.copy_(fresh.residual_TH)
        graph.replay()
        separate_x, separate_residual = PendingNorm(fresh.h_TH, fresh.residual_TH, fresh.weight_H, 1e-6,
                                                    False).apply()
        assert torch.equal(residual, separate_residual)
        if torch.equal(x, separate_x):
            assert torch.equal(y, small_m_linear(separate_x, w))
        check_norm_gemv(norm_gemv, fresh, w)
