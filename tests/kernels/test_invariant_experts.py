"""``invariant_experts.dense_experts``: a batch-invariant decode step's routed experts in a few
launches, bit for bit the per-expert loop of the graph form and the training side's ordered
combine (plain PyTorch float64 GEMMs here; the Triton kernels under the interpreter:
``interpreted_invariant_experts.py``; on the GPU: the ``gpu`` test)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.plugins.triton_interpret import run_interpreted


def expert_operands(dtype: torch.dtype, mlp):
    """A tiny MoE layer's inputs: 6 tokens, 4 experts (one chosen by no token), top 2, hidden 32,
    intermediate 16; and the per-expert MLP of the loop form."""
    generator = torch.Generator().manual_seed(0)
    x_TH = torch.randn(6, 32, generator=generator).to(dtype)
    ids_TK = torch.tensor([[0, 1], [1, 3], [0, 3], [3, 1], [0, 1], [1, 0]])
    weights_TK = torch.softmax(torch.randn(6, 2, generator=generator), dim=-1)
    gate_up_E2IH = (torch.randn(4, 32, 32, generator=generator) / 6).to(dtype)
    down_EHI = (torch.randn(4, 32, 16, generator=generator) / 4).to(dtype)

    def expert_mlp(x_e, expert):
        return mlp.gated_expert(x_e, gate_up_E2IH[expert], down_EHI[expert], torch.nn.functional.silu)

    return x_TH, ids_TK, weights_TK, gate_up_E2IH, down_EHI, expert_mlp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_experts_are_the_loop_and_the_training_combine(dtype):
    from miles_host.kernels import invariant_experts
    from miles_host.kernels.invariant_ops import batch_invariant_aten
    from miles_host.models import mlp

    x_TH, ids_TK, weights_TK, gate_up_E2IH, down_EHI, expert_mlp = expert_operands(dtype, mlp)
    with batch_invariant_aten("CPU"):
        batched = invariant_experts.dense_experts(x_TH, ids_TK, weights_TK, gate_up_E2IH, down_EHI,
                                                  torch.nn.functional.silu)
        loop = mlp._dense_over_experts(x_TH, ids_TK, weights_TK, 4, expert_mlp, ordered=True)
        training = mlp._ordered_combine(x_TH, ids_TK, weights_TK, 4, expert_mlp)
    assert batched.dtype == dtype
    assert torch.equal(batched, loop) and torch.equal(batched, training)


def test_the_switch_is_a_run_flag():
    from miles_host.kernels import invariant_experts, switches

    assert invariant_experts.batched()  # the default
    with switches.switched(moe_invariant_decode="loop"):
        assert not invariant_experts.batched()
    with pytest.raises(ValueError, match="--moe-invariant-decode 'grouped'"):
        switches.setVALUES(moe_invariant_decode="grouped")


def test_cpu_kernels_under_the_triton_interpreter(request):
    run_interpreted(Path(__file__).with_name("interpreted_invariant_experts.py"), request)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_batched_experts_on_cuda_are_the_loop_and_the_training_combine(tokens):
    """The Triton kernels on the GPU at the MoE bench's expert shape (64 experts, hidden 1024,
    intermediate 384, top 8): the batched form, the loop form and the training combine agree bit
    for bit at decode batch sizes."""
    from miles_host.kernels import invariant_experts
    from miles_host.kernels.invariant_ops import batch_invariant_aten
    from miles_host.models import mlp

    generator = torch.Generator(device="cuda").manual_seed(0)
    experts, hidden, inter = 64, 1024, 384
    x_TH = torch.randn(tokens, hidden, device="cuda", generator=generator).bfloat16()
    ids_TK = torch.rand(tokens, experts, device="cuda", generator=generator).topk(8, dim=-1).indices
    weights_TK = torch.softmax(torch.randn(tokens, 8, device="cuda", generator=generator), dim=-1)
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=generator) / 32).bfloat16()
    down = (torch.randn(experts, hidden, inter, device="cuda", generator=generator) / 20).bfloat16()

    def expert_mlp(x_e, expert):
        return mlp.gated_expert(x_e, gate_up[expert], down[expert], torch.nn.functional.silu)

    with batch_invariant_aten("CUDA"):
        batched = invariant_experts.dense_experts(x_TH, ids_TK, weights_TK, gate_up, down, torch.nn.functional.silu)
        loop = mlp._dense_over_experts(x_TH, ids_TK, weights_TK, experts, expert_mlp, ordered=True)
        training = mlp._ordered_combine(x_TH, ids_TK, weights_TK, experts, expert_mlp)
    assert torch.equal(batched, loop) and torch.equal(batched, training)
