"""The bf16 small-M decode GEMM (:mod:`miles_host.kernels.small_m_gemm`) against its float64
reference: on CPU under Triton's interpreter (``interpreted_small_m_gemm.py``), on a GPU
(marked ``gpu``) at the Qwen3-30B-A3B attention shapes, inside a CUDA graph, through
:func:`decode_linear`, and the engine's decode with it against the eager forward's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_host.kernels.small_m_gemm import MAX_M, decode_linear, fits, small_m_linear_reference
from tests.plugins.triton_interpret import run_interpreted

#: (name, N, K) of a Qwen3-30B-A3B attention layer and a Qwen3-1.7B MLP
SHAPES = [("qkv_proj", 5120, 2048), ("o_proj", 2048, 4096), ("gate_up_proj", 12288, 2048), ("down_proj", 2048, 6144)]


def operands(m: int, n: int, k: int, dtype=torch.bfloat16, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).to(dtype)
    w = (torch.randn(n, k, generator=generator) * 0.05).to(dtype)
    return x.to(device), w.to(device)


def assert_within_rounding(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within one bf16 rounding step of the float64 result (fp32 sums in another order)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), rtol=2.0**-7, atol=1e-5 * scale)


def test_cpu_kernel_under_the_triton_interpreter(request):
    run_interpreted(Path(__file__).with_name("interpreted_small_m_gemm.py"), request)


def test_what_the_kernel_takes_and_what_falls_back_to_the_module():
    x, w = operands(2, 128, 256)
    assert fits(x, w) and not fits(x.float(), w.float()) and not fits(x[:, :200], w[:, :200])
    assert not fits(operands(MAX_M + 1, 128, 256)[0], w) and not fits(x, w[:100])
    linear = torch.nn.Linear(256, 128, bias=True).to(torch.bfloat16)
    with torch.no_grad():  # on CPU the module itself runs
        assert torch.equal(decode_linear(linear, x), linear(x))


def test_the_lm_head_takes_the_small_m_gemm_only_where_the_table_names_its_shape(monkeypatch):
    from miles_host.kernels import small_m_gemm

    calls = []
    monkeypatch.setattr(small_m_gemm, "decode_matmul", lambda x, w: calls.append(tuple(w.shape)) or x @ w.T)
    x, w = operands(1, 128, 256)
    assert torch.equal(small_m_gemm.swept_matmul(x, w), torch.nn.functional.linear(x, w)) and not calls
    monkeypatch.setitem(small_m_gemm.LAUNCHES, (1, 128, 256), small_m_gemm.Launch("gemv", 16, 128, 1, 4, 1))
    small_m_gemm.swept_matmul(x, w)
    small_m_gemm.swept_matmul(operands(2, 128, 256)[0], w)  # two rows: not the swept shape
    assert calls == [(128, 256)]

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("name,n,k", SHAPES)
def test_gpu_kernel_gives_the_float64_reference(name, n, k, m):
    from miles_host.kernels.small_m_gemm import small_m_linear

    x, w = operands(m, n, k, device="cuda")
    assert_within_rounding(small_m_linear(x, w), small_m_linear_reference(x, w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,n,k", SHAPES[:2] + [("router", 128, 2048), ("lm_head", 151936, 2048)])
def test_gpu_one_token_gemv_launches_give_the_float64_reference(name, n, k):
    """Every GEMV launch the sweep tries (bench/small_m_sweep.py), at the decode shapes."""
    from bench.small_m_sweep import candidates
    from miles_host.kernels.small_m_gemm import small_m_linear

    x, w = operands(1, n, k, device="cuda")
    expected = small_m_linear_reference(x, w)
    for label, launch in candidates(1, n, k):
        if launch is not None and launch.tiles(n, k) and (k // launch.block_k) % (launch.split or 1) == 0:
            try:
                assert_within_rounding(small_m_linear(x, w, launch=launch), expected)
            except AssertionError as error:
                raise AssertionError(f"{name} {label}: {error}") from None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernel_in_a_cuda_graph_and_through_decode_linear():
    from miles_host.kernels.small_m_gemm import small_m_linear

    x, w = operands(1, 5120, 2048, device="cuda")
    static_x = x.clone()
    small_m_linear(static_x, w)  # compile, workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = small_m_linear(static_x, w)
    for seed in range(3):
        x_new, _ = operands(1, 5120, 2048, device="cuda", seed=seed + 1)
        static_x.copy_(x_new)
        graph.replay()
        assert torch.equal(static_y, small_m_linear(x_new, w))
        assert_within_rounding(static_y, small_m_linear_reference(x_new, w))
    linear = torch.nn.Linear(2048, 5120, bias=True, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():  # the bias is added to the rounded product, as F.linear's epilogue would not
        assert torch.equal(decode_linear(linear, x), small_m_linear(x, linear.weight) + linear.bias)
