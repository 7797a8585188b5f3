"""CPU tests of :mod:`miles_host.kernels.moe_grouped` under Triton's interpreter (not collected by itself).

Run by ``test_moe_grouped.py::test_cpu_kernel_under_the_triton_interpreter`` in a
fresh process with ``TRITON_INTERPRET=1``; alone:
``TRITON_INTERPRET=1 python -m pytest tests/kernels/interpreted_moe_grouped.py``.
Shapes stay tiny (H=32, I=16, E=8, K=2): the interpreter runs every program in numpy.
"""

from __future__ import annotations

import pytest
import torch

from miles_host.models.mlp import _ordered_combine, routed_forward
from tests.kernels.test_moe_grouped import assert_close, make_experts, routing_inputs
from tests.plugins.triton_interpret import interpreted_module

HIDDEN, INTER, EXPERTS, TOP_K = 32, 16, 8, 2


@pytest.fixture(scope="module")
def kernels():
    return interpreted_module("miles_host.kernels.moe_grouped")


def _args(num_tokens, dtype, num_experts=EXPERTS, top_k=TOP_K, act="silu", allowed=None):
    experts = make_experts(HIDDEN, INTER, num_experts, top_k, dtype, act=act)
    x, ids, weights = routing_inputs(num_tokens, HIDDEN, num_experts, top_k, dtype, allowed=allowed)
    return experts, (x, ids, weights, experts.gate_up_proj, experts.down_proj)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 5, 17])
def test_matches_the_float64_reference(kernels, dtype, num_tokens):
    _, args = _args(num_tokens, dtype)
    got = kernels.grouped_moe_forward(*args)
    assert got.shape == (num_tokens, HIDDEN) and got.dtype == dtype
    assert_close(got, kernels.grouped_moe_forward_reference(*args), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 17])
def test_matches_routed_forward(kernels, dtype, num_tokens):
    experts, args = _args(num_tokens, dtype)
    x, ids, weights = args[:3]
    got = kernels.grouped_moe_forward(*args)
    assert_close(got, routed_forward(x, ids, weights, EXPERTS, experts.expert_mlp), dtype)


def test_fp32_agrees_with_the_ordered_combine(kernels):
    """Same per-expert math, same fp32 combine order: within fp32 GEMM reassociation of ``_ordered_combine``."""
    experts, args = _args(17, torch.float32)
    expected = _ordered_combine(*args[:3], EXPERTS, experts.expert_mlp)
    torch.testing.assert_close(kernels.grouped_moe_forward(*args), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_experts(kernels, dtype):
    """Only experts 1 and 6 chosen: every other expert has no rows, most row blocks are unused."""
    _, args = _args(17, dtype, allowed=[1, 6])
    assert_close(kernels.grouped_moe_forward(*args), kernels.grouped_moe_forward_reference(*args), dtype)


def test_no_tokens(kernels):
    _, args = _args(0, torch.bfloat16)
    got = kernels.grouped_moe_forward(*args)
    assert got.shape == (0, HIDDEN) and got.dtype == torch.bfloat16


def test_many_experts_top_8_and_block_sizes(kernels):
    """E=128, K=8 (T*K < block_m for T=1); the row block changes the layout, not the result."""
    _, args = _args(5, torch.float32, num_experts=128, top_k=8)
    expected = kernels.grouped_moe_forward_reference(*args)
    assert_close(kernels.grouped_moe_forward(*args), expected, torch.float32)
    assert_close(kernels.grouped_moe_forward(*[a[:1] if i < 3 else a for i, a in enumerate(args)]),
                 expected[:1], torch.float32)
    _, args = _args(17, torch.float32)
    reference = kernels.grouped_moe_forward_reference(*args)
    for block_m in (16, 32):
        assert_close(kernels.grouped_moe_forward(*args, block_m=block_m), reference, torch.float32)


def test_other_activation_and_strided_weights(kernels):
    """``gelu_tanh`` through the eager activation; weights stored transposed (strides, no copy)."""
    experts, (x, ids, weights, gate_up, down) = _args(5, torch.float32, act="gelu_tanh")
    expected = routed_forward(x, ids, weights, EXPERTS, experts.expert_mlp)
    gate_up_t = gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    down_t = down.transpose(1, 2).contiguous().transpose(1, 2)
    got = kernels.grouped_moe_forward(x, ids, weights, gate_up_t, down_t, "gelu_tanh")
    assert_close(got, expected, torch.float32)


def test_fp32_router_weights_with_bf16_activations(kernels):
    """Gate weights in float32 (``router_fp32``) with bf16 experts: used in fp32, output in bf16."""
    experts, (x, ids, weights, gate_up, down) = _args(17, torch.bfloat16)
    got = kernels.grouped_moe_forward(x, ids, weights.float(), gate_up, down)
    assert got.dtype == torch.bfloat16
    assert_close(got, kernels.grouped_moe_forward_reference(x, ids, weights.float(), gate_up, down), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, allowed", [(1, None), (5, None), (17, None), (17, [1, 6])])
def test_the_combine_in_the_down_epilogue_gives_the_same_bits(kernels, monkeypatch, dtype, num_tokens, allowed):
    """``--moe-combine epilogue``: the last of a token's rows to finish sums them in the down GEMM's
    launch; the output equals the separate combine launch's bit for bit and the counters end at zero."""
    from miles_host.kernels import split_k
    from tests.kernel_switches import use_switches

    _, args = _args(num_tokens, dtype, allowed=allowed)
    separate = kernels.grouped_moe_forward(*args)
    use_switches(monkeypatch, moe_combine="epilogue")
    counters = torch.zeros(1 << 14, dtype=torch.int32)
    monkeypatch.setattr(split_k, "semaphores", lambda device, count: counters)
    monkeypatch.setattr(kernels, "combine", lambda *a: pytest.fail("the separate combine ran"))
    fused = kernels.grouped_moe_forward(*args)
    assert torch.equal(fused, separate)
    assert not counters.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens, allowed", [(1, None), (3, None), (3, [2, 5])])
@pytest.mark.parametrize("combine", ["separate", "epilogue"])
def test_the_one_pair_gemv_gives_the_float64_reference(kernels, monkeypatch, dtype, num_tokens, allowed, combine):
    """``--moe-gemv-tokens``: the experts of a few tokens by the CUDA-core GEMV (the grouped GEMM never
    runs) within the grouped path's tolerance of the float64 reference."""
    from miles_host.kernels import _moe_grouped_triton
    from tests.kernel_switches import use_switches

    _, args = _args(num_tokens, dtype, allowed=allowed)
    use_switches(monkeypatch, moe_gemv_tokens=4, moe_combine=combine)
    monkeypatch.setattr(_moe_grouped_triton, "moe_gemm", lambda *a, **k: pytest.fail("the grouped GEMM ran"))
    got = kernels.grouped_moe_forward(*args)
    assert_close(got, kernels.grouped_moe_forward_reference(*args), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens, allowed", [(1, None), (3, None), (3, [2, 5])])
@pytest.mark.parametrize("block_n", [4, 16])
def test_the_gemv_with_the_combine_gives_the_separate_launches_bits(kernels, monkeypatch, dtype, num_tokens,
                                                                     allowed, block_n):
    """``--moe-combine epilogue`` on the GEMV path: the down GEMV and the top-k sum in one launch
    (:func:`moe_gemv_combine`) equal the GEMV then the combine launch bit for bit, at any column tile."""
    from miles_host.kernels import _moe_grouped_triton, moe_configs
    from tests.kernel_switches import use_switches

    _, args = _args(num_tokens, dtype, allowed=allowed)
    use_switches(monkeypatch, moe_gemv_tokens=4, moe_combine="separate")
    separate = kernels.grouped_moe_forward(*args)
    use_switches(monkeypatch, moe_gemv_tokens=4, moe_combine="epilogue")
    launches = {**moe_configs.GEMV_LAUNCHES, "down_combine": moe_configs.GemvLaunch(block_n)}
    monkeypatch.setattr(kernels, "GEMV_LAUNCHES", launches)
    monkeypatch.setattr(_moe_grouped_triton, "combine", lambda *a: pytest.fail("the separate combine ran"))
    assert torch.equal(kernels.grouped_moe_forward(*args), separate)
