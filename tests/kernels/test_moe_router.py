"""The fused MoE router (:mod:`miles_host.kernels.moe_router`) against its float64 reference.

CPU: ``interpreted_moe_router.py`` runs the kernel under Triton's interpreter in a
subprocess (every routing variant, ties, the row layout against ``route``, the MoE
block's fused path against its eager router); here: the reference against the MoE
block's eager router, the sm_90 build of the kernel, the switch.
GPU (marked ``gpu``): ``python -m pytest tests/kernels/test_moe_router.py -m gpu -v -s`` at
the Qwen3-30B-A3B and DeepSeek-V3 router shapes, CUDA-graph capture and replay, the MoE
block in a graph, and a timing print of one MoE block with the fused and the eager router.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_host.kernels.moe_router import RouterSpec, router_reference, supports
from miles_host.models.config import MoEConfig
from miles_host.models.mlp import MoE, set_moe_router
from tests.plugins.triton_interpret import run_interpreted

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: router variants of the kernel tests (E=16): RouterSpec fields, ``bias`` for an e_score_correction_bias
VARIANTS = {
    "softmax_norm": dict(top_k=4),
    "softmax_raw": dict(top_k=3, norm_topk_prob=False),
    "softmax_bias_scaled": dict(top_k=4, routed_scaling_factor=1.5, bias=True),
    "softmax_group_raw": dict(top_k=2, n_group=4, topk_group=1, norm_topk_prob=False),
    "sigmoid_raw": dict(top_k=4, score_func="sigmoid", norm_topk_prob=False),
    "sigmoid_norm_bias_scaled": dict(top_k=4, score_func="sigmoid", norm_eps=1e-20, routed_scaling_factor=2.5,
                                     bias=True),
    "sigmoid_group_bias_scaled": dict(top_k=4, score_func="sigmoid", n_group=4, topk_group=2, norm_eps=1e-20,
                                      routed_scaling_factor=2.5, bias=True),
}

#: MoE block configs (MoEConfig kwargs, E=16) of the model families the fused router serves
MOE_VARIANTS = {
    "qwen3": dict(top_k=4, score_func="softmax", norm_topk_prob=True),
    "deepseek_v3": dict(top_k=4, score_func="sigmoid", n_group=4, topk_group=2, expert_bias=True, norm_eps=1e-20,
                        routed_scaling_factor=2.5, norm_topk_prob=True, router_fp32=True, shared_intermediate_size=24),
    "glm45_shared": dict(top_k=2, score_func="sigmoid", expert_bias=True, routed_scaling_factor=2.5,
                         norm_topk_prob=True, shared_intermediate_size=24),
}


def spec_of(variant: str, num_experts: int = 16) -> tuple[RouterSpec, torch.Tensor | None]:
    fields = dict(VARIANTS[variant])
    with_bias = fields.pop("bias", False)
    bias = torch.randn(num_experts, generator=torch.Generator().manual_seed(11)) * 0.1 if with_bias else None
    return RouterSpec(num_experts=num_experts, **fields), bias


def make_logits(num_tokens: int, num_experts: int, seed: int = 0, device="cpu") -> torch.Tensor:
    return torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed)).to(device)


def test_router_kernel_under_the_triton_interpreter(request):
    """Every variant, ties, the layout, the MoE block's fused path (see interpreted_moe_router.py)."""
    run_interpreted(Path(__file__).with_name("interpreted_moe_router.py"), request)


@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
def test_reference_is_the_eager_router(variant):
    """What the MoE block hands its experts (eager router, float64) = :func:`router_reference` of its logits."""
    torch.manual_seed(0)
    block = MoE(32, MoEConfig(num_experts=16, intermediate_size=16, **MOE_VARIANTS[variant]), "silu", 0).double()
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape) / param.shape[-1] ** 0.5)
        if block.router.expert_bias is not None:
            block.router.expert_bias.copy_(torch.randn(16) * 0.1)
    seen = []
    block.experts.forward = lambda x, ids, weights, routing=None: seen.append((ids, weights)) or torch.zeros_like(x)
    x = torch.randn(9, 32, dtype=torch.float64)
    with torch.no_grad():
        block(x)
        expected_ids, expected_weights = router_reference(block.router.logits(x), block.router_spec,
                                                          block.router.expert_bias)
    ids, weights = seen[0]
    ids_sorted, order = ids.sort(dim=-1)
    assert torch.equal(ids_sorted, expected_ids)
    # the eager router scores in float32 whatever the model's dtype
    torch.testing.assert_close(weights.gather(1, order).double(), expected_weights, rtol=1e-6, atol=1e-6)


def test_supports_and_set_moe_router():
    assert supports(RouterSpec(128, 8), 1) and supports(RouterSpec(128, 8), 64)
    assert not supports(RouterSpec(128, 8), 65) and not supports(RouterSpec(128, 8), 0)
    assert supports(RouterSpec(256, 8, "sigmoid", 8, 4), 64) and not supports(RouterSpec(512, 8), 64)
    assert not supports(RouterSpec(8, 2, n_group=8), 1)  # one expert per group: no top-2
    block = MoE(32, MoEConfig(num_experts=8, top_k=2, intermediate_size=16), "silu", 0)
    assert block.router_kernel == "fused"
    assert set_moe_router(torch.nn.Sequential(block, block), "torch") == 1 and block.router_kernel == "torch"
    with pytest.raises(ValueError, match="router"):
        set_moe_router(block, "triton")


@pytest.mark.parametrize("group", [False, True])
@pytest.mark.parametrize("num_tokens,num_warps", [(1, 1), (64, 8)])
def test_kernel_compiles_for_sm90(group, num_tokens, num_warps):
    """The GPU branches build for the H200 without spilling (the Qwen3 and DeepSeek-V3 routers, batch 1 in
    one warp with the one-token layout, T=64 in eight)."""
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra installs it)")
    from miles_host.kernels import _moe_router_triton
    from miles_host.kernels._moe_grouped_triton import layout_constants
    from tests.plugins.triton_sm90 import compile_sm90

    signature = {"Logits": "*fp32" if group else "*bf16", "Bias": "*fp32", "Ids": "*i64",
                 "Weights": "*fp32" if group else "*bf16", "RowToken": "*i64", "PairRow": "*i64",
                 "BlockExpert": "*i32", "Scratch": "*i32", "num_tokens": "i32", "stride_lt": "i32",
                 "num_rows": "i32", "num_blocks": "i32", "norm_eps": "fp32", "scaling": "fp32"}
    experts, groups, kept = (256, 8, 4) if group else (128, 1, 1)
    constexprs = dict(TOP_K=8, K_P=8, T_P=max(2, num_tokens), G=groups, G_P=groups, S=experts // groups,
                      S_P=experts // groups,
                      TOPK_GROUP=kept, SOFTMAX=not group, HAS_BIAS=group, NORM=True, EMULATE=False,
                      ONE_TOKEN=num_tokens == 1, **layout_constants(num_tokens * 8, experts, 16))
    ptx = compile_sm90(_moe_router_triton._router_kernel, signature, constexprs, num_warps, 1,
                       unaligned=("num_tokens", "num_rows", "num_blocks", "norm_eps", "scaling"))
    assert ".local" not in ptx
    assert num_tokens == 1 or "bar.sync" in ptx  # the ids' read-back (one token's layout needs none)


# ----------------------------------------------------------------------------- GPU

#: (router spec, logits dtype, bias) of the GPU tests: Qwen3-30B-A3B (bf16 router), DeepSeek-V3 (fp32 router)
GPU_ROUTERS = {
    "qwen3_30b": (RouterSpec(128, 8), torch.bfloat16, False),
    "dsv3": (RouterSpec(256, 8, "sigmoid", 8, 4, True, 1e-20, 2.5), torch.float32, True),
}


def _gpu_inputs(shape: str, num_tokens: int, seed: int):
    spec, dtype, with_bias = GPU_ROUTERS[shape]
    logits = make_logits(num_tokens, spec.num_experts, seed, "cuda").to(dtype)
    bias = make_logits(1, spec.num_experts, 99, "cuda")[0] * 0.05 if with_bias else None
    return spec, logits, bias, dtype


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("shape", sorted(GPU_ROUTERS))
@pytest.mark.parametrize("num_tokens", [1, 8, 37, 64])
def test_gpu_router_matches_the_reference(shape, num_tokens):
    from miles_host.kernels.moe_grouped import route
    from miles_host.kernels.moe_router import fused_route

    spec, logits, bias, dtype = _gpu_inputs(shape, num_tokens, seed=num_tokens)
    ids, routing = fused_route(logits, spec, bias, 16, dtype)
    expected_ids, expected_weights = router_reference(logits, spec, bias)
    assert torch.equal(ids, expected_ids)
    tol = 8e-3 if dtype == torch.bfloat16 else 2e-6
    torch.testing.assert_close(routing.weights_TK.double(), expected_weights, rtol=tol, atol=tol)
    expected = route(ids, routing.weights_TK, spec.num_experts, 16)
    for name in ("row_token_R", "block_expert_B", "pair_row_TK"):
        assert torch.equal(getattr(routing, name), getattr(expected, name)), name


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("shape", sorted(GPU_ROUTERS))
def test_gpu_every_warp_count_gives_the_same_bits(shape):
    """The one program with 1, 2, 4 or 8 warps (the default picks by the tile; at 64 tokens only 4 or 8:
    Triton takes minutes to compile the DeepSeek-V3 tile of 64 x 256 scores for one or two warps): same ids and layout;
    the weights within a few float32 ulps (the warps sum the top-k weights in a different order,
    measured on the H200 for the DeepSeek-V3 router: sigmoid scores renormalised over 8 experts)."""
    from miles_host.kernels.moe_router import fused_route

    for num_tokens, warp_counts in ((1, (1, 2, 4, 8)), (8, (1, 2, 4, 8)), (64, (4, 8))):
        spec, logits, bias, dtype = _gpu_inputs(shape, num_tokens, seed=5)
        ids, routing = fused_route(logits, spec, bias, 16, dtype)
        for warps in warp_counts:
            other_ids, other = fused_route(logits, spec, bias, 16, dtype, num_warps=warps)
            assert torch.equal(ids, other_ids), (num_tokens, warps)
            for name in ("row_token_R", "block_expert_B", "pair_row_TK"):
                assert torch.equal(getattr(routing, name), getattr(other, name)), (num_tokens, warps, name)
            torch.testing.assert_close(other.weights_TK, routing.weights_TK, rtol=4e-7, atol=0)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("shape", sorted(GPU_ROUTERS))
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_gpu_cuda_graph_capture_and_replay(shape, num_tokens):
    """Captured once, replayed on new logits copied into the static input: equal to eager calls."""
    from miles_host.kernels.moe_router import fused_route

    spec, logits, bias, dtype = _gpu_inputs(shape, num_tokens, seed=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (Triton compiles) outside the capture
        fused_route(logits, spec, bias, 16, dtype)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_ids, static_routing = fused_route(logits, spec, bias, 16, dtype)
    for seed in (2, 3, 4):
        fresh = _gpu_inputs(shape, num_tokens, seed)[1]
        logits.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        ids, routing = fused_route(fresh, spec, bias, 16, dtype)
        assert torch.equal(static_ids, ids), seed
        for name in ("row_token_R", "block_expert_B", "pair_row_TK", "weights_TK"):
            assert torch.equal(getattr(static_routing, name), getattr(routing, name)), (seed, name)


def _qwen3_block(device="cuda") -> MoE:
    """One MoE block of the Qwen3-30B-A3B shape (H 2048, I 768, E 128, K 8), bf16, random init."""
    torch.manual_seed(0)
    block = MoE(2048, MoEConfig(num_experts=128, top_k=8, intermediate_size=768), "silu", 0)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.02)
    return block.to(device, torch.bfloat16).eval()


def _graphed(fn, inner: int = 10):
    """A CUDA graph of ``inner`` calls of ``fn`` (after a warm-up on a side stream) and its last output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            out = fn()
    return graph, out


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_gpu_moe_block_in_a_graph_with_the_fused_router(num_tokens):
    """The MoE block at the 30B-A3B shape, captured with the fused router: its replay = the eager router's output."""
    from miles_host.models.mlp import uses_fused_router

    block = _qwen3_block()
    x = torch.randn(num_tokens, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        assert uses_fused_router(block, x)
        graph, out = _graphed(lambda: block(x), inner=1)
        graph.replay()
        torch.cuda.synchronize()
        block.router_kernel = "torch"
        eager = block(x)
    torch.testing.assert_close(out.double(), eager.double(), rtol=3e-2, atol=3e-2 * eager.abs().max().item())


@pytest.mark.gpu
@requires_cuda
def test_gpu_decode_graphs_capture_the_fused_router(monkeypatch):
    """The engine's decode graphs (batch sizes within the fused router's limit) hold the fused router,
    and a generation through them runs to the end."""
    from bench.moe_models import build_model
    from miles_host.kernels import moe_router
    from miles_host.rollout import Engine

    calls = []
    original = moe_router.fused_route
    monkeypatch.setattr(moe_router, "fused_route", lambda logits, *a, **k: calls.append(
        (logits.shape[0], torch.cuda.is_current_stream_capturing())) or original(logits, *a, **k))
    engine = Engine(build_model("tiny", torch.bfloat16, "cuda"), tokenizer=None, max_num_seqs=4, max_model_len=64,
                    max_kv_cache_tokens=4096)
    assert engine.runner.graphs is not None and any(capturing for _, capturing in calls)
    results = engine.generate([[1, 2, 3], [4, 5]], [{"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}] * 2,
                              return_logprob=False)
    assert [r["meta_info"]["completion_tokens"] for r in results] == [8, 8]
