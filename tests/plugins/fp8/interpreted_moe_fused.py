"""CPU tests of :mod:`miles_fp8.moe_fused` under Triton's interpreter (not collected by itself).

Run by ``test_moe_fused.py::test_fused_fp8_experts_under_the_triton_interpreter`` in a
fresh process with ``TRITON_INTERPRET=1``. The oracle: the same ``Fp8InferenceExperts``
through the per-expert loop on the plugin's reference GEMM (dequantized operands in
float32), and a float64 per-expert model of the same quantization.
"""

from __future__ import annotations

import pytest
import torch

from miles_host.models.mlp import uses_fused_moe
from tests.plugins.fp8.test_moe_fused import float64_reference, make_fp8_experts, routing
from tests.plugins.triton_interpret import interpreted_module


@pytest.fixture(scope="module")
def kernels():
    return interpreted_module("miles_fp8.moe_fused")


@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("num_tokens,allowed", [(1, None), (6, None), (9, [2])])  # batch 1, > experts, one expert
def test_fused_fp8_experts_match_the_loop_and_float64(kernels, num_tokens, allowed, power_of_two):
    experts = make_fp8_experts(power_of_two)
    x, ids, weights = routing(num_tokens, allowed)
    with torch.no_grad():
        assert uses_fused_moe(experts, x)
        fused = experts(x, ids, weights)
        experts.moe_kernel = "loop"
        loop = experts(x, ids, weights)
    scale = loop.float().abs().max().item()
    torch.testing.assert_close(fused.float(), loop.float(), rtol=0, atol=2e-2 * scale)
    expected = float64_reference(experts, x, ids, weights)
    torch.testing.assert_close(fused.double(), expected, rtol=0, atol=2e-2 * scale)


def test_fused_router_layout_is_used_as_is(kernels):
    """The host's fused router hands its row layout in (``routing=``): same output as planning it here."""
    from miles_host.kernels.moe_router import RouterSpec, fused_route

    experts = make_fp8_experts()
    x, _, _ = routing(6)
    ids, layout = fused_route(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), RouterSpec(4, 2), None,
                              16, torch.bfloat16)
    assert experts.weight_format == "fp8_block128"
    with torch.no_grad():
        assert torch.equal(experts(x, ids, layout.weights_TK, routing=layout), experts(x, ids, layout.weights_TK))
