"""FP8 experts in the fused MoE (:mod:`miles_fp8.moe_fused`) against the per-expert loop and a float64 model.

CPU: ``interpreted_moe_fused.py`` under the Triton interpreter (H = I = 128, E = 4, K = 2).
GPU (``-m gpu``): the Qwen3-30B-A3B expert shape (H 2048, I 768, E 128, K 8), eager and
inside a CUDA graph.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_fp8.experts import Fp8InferenceExperts
from miles_fp8.quant import dequantize, quantize_act_ref
from miles_host.models.config import MoEConfig
from miles_host.models.mlp import Experts
from tests.plugins.triton_interpret import run_interpreted

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_fp8_experts(power_of_two=False, hidden=128, inter=128, num_experts=4, device="cpu") -> Fp8InferenceExperts:
    torch.manual_seed(0)
    experts = Experts(hidden, MoEConfig(num_experts=num_experts, top_k=2, intermediate_size=inter), "silu")
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape) / hidden**0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape) / inter**0.5)
    return Fp8InferenceExperts.from_experts(experts.to(device), power_of_two).eval()


def routing(num_tokens, allowed=None, hidden=128, num_experts=4, top_k=2, device="cpu"):
    generator = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=generator).bfloat16()
    pool = torch.arange(num_experts) if allowed is None else torch.as_tensor(allowed)
    if len(pool) < top_k:  # every token's first slot on the one allowed expert
        ids = torch.stack([pool[0].expand(num_tokens), torch.full((num_tokens,), (int(pool[0]) + 1) % num_experts)], 1)
    else:
        ids = torch.stack([pool[torch.randperm(len(pool), generator=generator)[:top_k]] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=generator)
    return x.to(device), ids.to(device), (weights / weights.sum(-1, keepdim=True)).bfloat16().to(device)


def float64_reference(experts: Fp8InferenceExperts, x, ids, weights) -> torch.Tensor:
    """Per expert in float64: 1x128-quantized activations times the dequantized 128x128-block weights;
    the bf16 roundings of the rollout module (gate/up, activation, product) in between."""
    def linear(a, w_q, w_s):
        a_q, a_s = quantize_act_ref(a.float(), experts.power_of_two)
        return (dequantize(a_q, a_s).double() @ dequantize(w_q, w_s).double().t()).bfloat16()

    y = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(experts.num_experts):
        tokens, slots = torch.nonzero(ids.cpu() == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate, up = linear(x.cpu()[tokens], experts.gate_up_proj[e].cpu(), experts.gate_up_proj_scale_inv[e].cpu()).chunk(2, -1)
        act = (torch.nn.functional.silu(gate) * up).bfloat16()
        out = linear(act, experts.down_proj[e].cpu(), experts.down_proj_scale_inv[e].cpu()).double()
        y.index_add_(0, tokens, out * weights.cpu()[tokens, slots].double()[:, None])
    return y.to(x.device)


def test_fused_fp8_experts_under_the_triton_interpreter(request):
    run_interpreted(Path(__file__).with_name("interpreted_moe_fused.py"), request)


def test_cpu_without_the_interpreter_takes_the_loop():
    experts = make_fp8_experts()
    x, ids, weights = routing(3)
    with torch.no_grad():
        got = experts(x, ids, weights)
        experts.moe_kernel = "loop"
        assert torch.equal(got, experts(x, ids, weights))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [1, 32, 256, 1000])
def test_gpu_qwen3_30b_expert_shape(num_tokens):
    experts = make_fp8_experts(hidden=2048, inter=768, num_experts=128, device="cuda")
    x, ids, weights = routing(num_tokens, hidden=2048, num_experts=128, top_k=8, device="cuda")
    with torch.no_grad():
        fused = experts(x, ids, weights)
        graph_x, graph_ids, graph_w = x.clone(), ids.clone(), weights.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = experts(graph_x, graph_ids, graph_w)
        graph.replay()
        experts.moe_kernel = "loop"
        loop = experts(x, ids, weights)
    scale = loop.float().abs().max().item()
    torch.testing.assert_close(fused.float(), loop.float(), rtol=0, atol=2e-2 * scale)
    assert torch.equal(captured, fused)
    if num_tokens <= 32:
        expected = float64_reference(experts, x, ids, weights)
        torch.testing.assert_close(fused.double(), expected, rtol=0, atol=2e-2 * scale)


@pytest.mark.parametrize("gated", [True, False])
def test_kernel_compiles_for_sm90_on_fp8_tensor_cores(gated):
    """The GPU branch builds for the H200 and multiplies E4M3 operands on the tensor cores."""
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra installs it)")
    from miles_fp8 import moe_fused
    from tests.plugins.triton_sm90 import compile_sm90

    signature = {"A": "*bf16", "RowToken": "*i64", "BlockExpert": "*i32", "W": "*fp8e4nv", "WS": "*fp32",
                 "C": "*bf16", "N": "i32", "stride_am": "i32", "stride_we": "i32", "stride_wn": "i32",
                 "stride_wse": "i32", "stride_wsn": "i32", "stride_cm": "i32"}
    constexprs = dict(K_BLOCKS=16, GATHER=gated, GATED=gated, ACT=0, POW2=False, FP8_MMA=True, EMULATE=False,
                      BLOCK_M=16, BLOCK_N=64)
    ptx = compile_sm90(moe_fused._fp8_moe_gemm_kernel, signature, constexprs, 4, 3, unaligned=())
    assert "e4m3" in ptx and ("wgmma" in ptx or "mma" in ptx)
