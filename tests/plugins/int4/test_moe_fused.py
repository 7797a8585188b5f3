"""INT4 experts in the fused MoE (:mod:`miles_int4.moe_fused`) against the per-expert loop and a float64 model.

CPU: ``interpreted_moe_fused.py`` under the Triton interpreter (H = 64, I = 32, E = 4, K = 2,
groups of 32), on both storage paths of ``Int4Experts`` (``dequant`` buffers, ``packed``
with its compressed copy). GPU (``-m gpu``): the Qwen3-30B-A3B expert shape, group 128,
eager and inside a CUDA graph.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

from miles_host.kernels import switches
from miles_host.kernels.moe_configs import moe_tiles
from miles_host.kernels.moe_grouped import ExpertGemms, plan
from miles_host.models.config import MoEConfig
from miles_host.models.mlp import Experts
from miles_int4.quant import dequantize, quantize
from miles_int4.rollout import Int4Experts
from tests.plugins.triton_interpret import run_interpreted

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_experts(hidden=64, inter=32, num_experts=4, device="cpu") -> Experts:
    torch.manual_seed(0)
    experts = Experts(hidden, MoEConfig(num_experts=num_experts, top_k=2, intermediate_size=inter), "silu")
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape) / hidden**0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape) / inter**0.5)
    return experts.to(device, torch.bfloat16)


def routing(num_tokens, hidden=64, num_experts=4, top_k=2, device="cpu", one_expert=False):
    generator = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=generator).bfloat16()
    ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    if one_expert:
        ids = torch.stack([torch.full((num_tokens,), 1), torch.full((num_tokens,), 3)], 1)[:, :top_k]
    weights = torch.rand(num_tokens, top_k, generator=generator)
    return x.to(device), ids.to(device), (weights / weights.sum(-1, keepdim=True)).bfloat16().to(device)


def float64_reference(experts: Experts, group_size, x, ids, weights) -> torch.Tensor:
    """Per expert in float64 on the dequantized weights (the QAT weight), bf16 roundings as the module."""
    gate_up = dequantize(*quantize(experts.gate_up_proj.float().cpu(), group_size), torch.bfloat16).double()
    down = dequantize(*quantize(experts.down_proj.float().cpu(), group_size), torch.bfloat16).double()
    y = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(experts.num_experts):
        tokens, slots = torch.nonzero(ids.cpu() == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate, up = (x.cpu()[tokens].double() @ gate_up[e].t()).bfloat16().chunk(2, -1)
        act = (torch.nn.functional.silu(gate) * up).bfloat16()
        out = (act.double() @ down[e].t()).bfloat16().double()
        y.index_add_(0, tokens, out * weights.cpu()[tokens, slots].double()[:, None])
    return y.to(x.device)


def assert_gemv_matches_the_tensor_core_kernel(gemms: ExpertGemms, x_TH: torch.Tensor, ids_TK: torch.Tensor,
                                               weights_TK: torch.Tensor, switch: switches.Switch,
                                               takes_gemv: Callable[[object], bool]) -> None:
    """Both projections with ``switch`` (the GEMV's most tokens) at the batch's token count, then at 0: the pair
    rows agree within two bf16 roundings (gate, up and their product are each rounded after fp32 sums in
    another order) and are finite; the padding rows are left alone (NaN-filled here)."""
    num_tokens, top_k = ids_TK.shape
    layout = plan(ids_TK, weights_TK, gemms.num_experts, 16)
    tiles = moe_tiles(num_tokens, top_k, gemms.num_experts, gemms.hidden, gemms.inter, x_TH.dtype,
                      gemms.weight_format)
    rows = layout.pair_row_TK.reshape(-1)
    outputs = {}
    for most_tokens in (num_tokens, 0):
        with switches.switched(**{switch.name: most_tokens}):
            assert takes_gemv(layout) == bool(most_tokens)
            num_rows = layout.row_token_R.shape[0]
            act = torch.full((num_rows, gemms.inter), float("nan"), dtype=x_TH.dtype, device=x_TH.device)
            out = torch.full((num_rows, gemms.hidden), float("nan"), dtype=x_TH.dtype, device=x_TH.device)
            gemms.gate_up(x_TH, layout, act, tiles.gate_up)
            gemms.down(act, layout, out, tiles.down)
            outputs[most_tokens] = act[rows].float(), out[rows].float()
    for gemv_rows, mma_rows in zip(outputs[num_tokens], outputs[0]):
        assert torch.isfinite(gemv_rows).all()
        torch.testing.assert_close(gemv_rows, mma_rows, rtol=2**-6, atol=2**-7)


def test_fused_int4_experts_under_the_triton_interpreter(request):
    run_interpreted(Path(__file__).with_name("interpreted_moe_fused.py"), request)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [1, 32, 256, 1000])
def test_gpu_qwen3_30b_expert_shape(num_tokens):
    experts = make_experts(hidden=2048, inter=768, num_experts=128, device="cuda")
    module = Int4Experts(experts, 128, use_kernel=True)
    module.refresh(torch.bfloat16)
    x, ids, weights = routing(num_tokens, hidden=2048, num_experts=128, top_k=8, device="cuda")
    with torch.no_grad():
        fused = module(x, ids, weights)
        graph_args = [t.clone() for t in (x, ids, weights)]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = module(*graph_args)
        graph.replay()
        module.moe_kernel = "loop"
        loop = module(x, ids, weights)
    scale = loop.float().abs().max().item()
    torch.testing.assert_close(fused.float(), loop.float(), rtol=0, atol=2e-2 * scale)
    assert torch.equal(captured, fused)
    if num_tokens <= 32:
        expected = float64_reference(experts, 128, x, ids, weights)
        torch.testing.assert_close(fused.double(), expected, rtol=0, atol=2e-2 * scale)


@pytest.mark.parametrize("gated", [True, False])
def test_kernel_compiles_for_sm90(gated):
    """The GPU branch builds for the H200 with bf16 tensor-core products of the dequantized tiles."""
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra installs it)")
    import re

    from miles_int4 import moe_fused
    from tests.plugins.triton_sm90 import compile_sm90

    signature = {"A": "*bf16", "RowToken": "*i64", "BlockExpert": "*i32", "W": "*i32", "S": "*bf16", "C": "*bf16",
                 "N": "i32", "stride_am": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32",
                 "stride_sn": "i32", "stride_cm": "i32"}
    constexprs = dict(K_BLOCKS=16, GROUP=128, GATHER=gated, GATED=gated, ACT=0, IEEE=False, EMULATE=False,
                      BLOCK_M=16, BLOCK_N=64, BLOCK_K=128)
    ptx = compile_sm90(moe_fused._int4_moe_gemm_kernel, signature, constexprs, 4, 3, unaligned=())
    assert re.search(r"(wgmma|mma)\.\S*bf16", ptx)
    assert "cvt.rn.f32.s32" not in ptx  # nibbles dequantized without an int-to-float conversion


@pytest.mark.parametrize("gated", [True, False])
def test_one_token_gemv_compiles_for_sm90(gated):
    """The batch-1 GEMV's GPU branch: word-pair dequantization and fp32 FMAs in inline PTX."""
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra installs it)")
    from miles_int4 import moe_gemv
    from tests.plugins.triton_sm90 import compile_sm90

    signature = {"A": "*bf16", "RowToken": "*i64", "PairRow": "*i64", "BlockExpert": "*i32", "W": "*i32",
                 "S": "*bf16", "C": "*bf16", "N": "i32", "stride_am": "i32", "stride_we": "i32", "stride_wn": "i32",
                 "stride_se": "i32", "stride_sn": "i32", "stride_cm": "i32"}
    block_n = moe_gemv.GATE_UP_BLOCK_N if gated else moe_gemv.DOWN_BLOCK_N
    constexprs = dict(GROUPS=16, GROUP=128, ROW_BLOCK=16, GATHER=gated, GATED=gated, ACT=0, EMULATE=False,
                      BLOCK_N=block_n)
    ptx = compile_sm90(moe_gemv._int4_moe_gemv_kernel, signature, constexprs, moe_gemv.GEMV_WARPS, 3, unaligned=())
    for instruction in ("lop3.b32", "sub.rn.bf16x2", "mul.rn.bf16x2", "fma.rn.f32"):
        assert instruction in ptx, instruction
    assert "mma" not in ptx


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [1, 32])
def test_gpu_gemv_matches_the_tensor_core_kernel(num_tokens):
    from miles_int4 import kernel_switches, moe_gemv
    from miles_int4.moe_fused import Int4ExpertGemms

    module = Int4Experts(make_experts(hidden=2048, inter=768, num_experts=128, device="cuda"), 128, use_kernel=True)
    module.refresh(torch.bfloat16)
    x, ids, weights = routing(num_tokens, hidden=2048, num_experts=128, top_k=8, device="cuda")
    gemms = Int4ExpertGemms(*module._fused_operands("gate_up_proj"), *module._fused_operands("down_proj"), "silu")
    assert_gemv_matches_the_tensor_core_kernel(gemms, x, ids, weights, kernel_switches.MOE_GEMV_TOKENS,
                                               lambda layout: moe_gemv.takes_gemv(x, layout))
