"""CPU tests of :mod:`miles_host.kernels.invariant_experts` and ``invariant_bmm`` under Triton's
interpreter (not collected by itself; run by ``test_invariant_experts.py``)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_invariant_experts import expert_operands
from tests.plugins.triton_interpret import interpreted_module


@pytest.fixture(scope="module")
def kernels():
    return interpreted_module("miles_host.kernels.invariant_matmul")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("broadcast", [False, True])
def test_each_batch_entry_is_invariant_mm_of_it(kernels, dtype, broadcast):
    generator = torch.Generator().manual_seed(0)
    a_BMK = torch.randn(3, 17, 40, generator=generator).to(dtype)
    if broadcast:  # one input for every entry (batch stride 0)
        a_BMK = a_BMK[:1].expand(3, 17, 40)
    b_BNK = torch.randn(3, 24, 40, generator=generator).to(dtype)
    got = kernels.invariant_bmm(a_BMK, b_BNK.transpose(1, 2))
    for entry in range(3):
        assert torch.equal(got[entry], kernels.invariant_mm(a_BMK[entry], b_BNK[entry].t()))
    reference = kernels.invariant_mm_reference(a_BMK[1], b_BNK[1].t())
    torch.testing.assert_close(got[1].float(), reference.float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_experts_are_the_loop_and_the_training_combine_bit_for_bit(dtype):
    ops = interpreted_module("miles_host.kernels.invariant_ops")
    experts = interpreted_module("miles_host.kernels.invariant_experts")
    mlp = interpreted_module("miles_host.models.mlp")
    x_TH, ids_TK, weights_TK, gate_up_E2IH, down_EHI, expert_mlp = expert_operands(dtype, mlp)
    with ops.batch_invariant_aten("CPU"):
        batched = experts.dense_experts(x_TH, ids_TK, weights_TK, gate_up_E2IH, down_EHI, torch.nn.functional.silu)
        loop = mlp._dense_over_experts(x_TH, ids_TK, weights_TK, gate_up_E2IH.shape[0], expert_mlp, ordered=True)
        training = mlp._ordered_combine(x_TH, ids_TK, weights_TK, gate_up_E2IH.shape[0], expert_mlp)
    assert torch.equal(batched, loop)
    assert torch.equal(batched, training)
