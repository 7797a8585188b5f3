"""CPU tests of :mod:`miles_int4.moe_fused` under Triton's interpreter (not collected by itself).

Run by ``test_moe_fused.py::test_fused_int4_experts_under_the_triton_interpreter`` in a
fresh process with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import pytest
import torch

from miles_host.models.mlp import uses_fused_moe
from miles_int4.rollout import Int4Experts
from tests.plugins.int4.test_moe_fused import (
    assert_gemv_matches_the_tensor_core_kernel, float64_reference, make_experts, routing,
)
from tests.plugins.triton_interpret import interpreted_module


@pytest.fixture(scope="module")
def kernels():
    return interpreted_module("miles_int4.moe_fused")


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("num_tokens,one_expert", [(1, False), (7, False), (9, True)])  # batch 1, > experts
def test_fused_int4_experts_match_the_loop_and_float64(kernels, use_kernel, num_tokens, one_expert):
    experts = make_experts()
    module = Int4Experts(experts, 32, use_kernel=use_kernel)
    module.refresh(torch.bfloat16)
    x, ids, weights = routing(num_tokens, one_expert=one_expert)
    with torch.no_grad():
        assert uses_fused_moe(module, x)
        fused = module(x, ids, weights)
        module.moe_kernel = "loop"
        loop = module(x, ids, weights)
    scale = loop.float().abs().max().item()
    torch.testing.assert_close(fused.float(), loop.float(), rtol=0, atol=2e-2 * scale)
    torch.testing.assert_close(fused.double(), float64_reference(experts, 32, x, ids, weights), rtol=0,
                               atol=2e-2 * scale)


@pytest.fixture(scope="module")
def gemv():
    return interpreted_module("miles_int4.moe_gemv")


@pytest.mark.parametrize("group_size,num_tokens", [(16, 1), (32, 1), (32, 3)])
def test_gemv_matches_the_tensor_core_kernel(kernels, gemv, group_size, num_tokens):
    """Up to ``--int4-moe-gemv-tokens`` tokens take the CUDA-core GEMV: the same dequantized bf16 weights
    as the grouped MMA kernel, fp32 sums in another order (a bf16 rounding apart at most), on the used rows only."""
    from miles_host.kernels.moe_grouped import plan
    from miles_int4 import kernel_switches

    module = Int4Experts(make_experts(), group_size, use_kernel=False)
    module.refresh(torch.bfloat16)
    x, ids, weights = routing(num_tokens)
    gemms = kernels.Int4ExpertGemms(*module._fused_operands("gate_up_proj"), *module._fused_operands("down_proj"),
                                    "silu")
    assert gemv.takes_gemv(x, plan(ids, weights, 4, 16)) == (num_tokens == 1)  # batch 1 by default
    assert_gemv_matches_the_tensor_core_kernel(gemms, x, ids, weights, kernel_switches.MOE_GEMV_TOKENS,
                                               lambda layout: gemv.takes_gemv(x, layout))
