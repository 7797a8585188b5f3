"""The grouped-GEMM MoE forward (:mod:`miles_host.kernels.moe_grouped`) against its float64
reference and against ``routed_forward``.

CPU: ``interpreted_moe_grouped.py``, ``interpreted_moe_fused.py`` and ``interpreted_moe_gpt_oss.py``
(expert biases, clamped SwiGLU) run the Triton path under the interpreter in a subprocess
(tiny shapes: H=32, I=16, E=8, K=2); the routing layout, the tile table, the CPU
fallback and the ``--moe-kernel`` switch are checked here.
GPU (marked ``gpu``): ``python -m pytest tests/kernels/test_moe_grouped.py -m gpu -v -s``
on Qwen3-MoE shapes (H=1024, I=384, E=64, K=8): accuracy and CUDA-graph capture (the timings
against the per-expert loop are ``bench/moe.py``'s).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from miles_host.kernels.moe_grouped import (
    gemm_config, grouped_moe_forward, grouped_moe_forward_reference, pick_block_m, route,
)
from miles_host.models.config import MoEConfig
from miles_host.models.mlp import Experts, routed_forward
from tests.plugins.triton_interpret import run_interpreted

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: (H, I, E, K) of Qwen3-30B-A3B-shaped small MoE (the GPU tests)
QWEN3_MOE = (1024, 384, 64, 8)


def make_experts(hidden, inter, num_experts, top_k, dtype, device="cpu", seed=0, act="silu") -> Experts:
    """A randomly initialised ``Experts`` (weights scaled to keep activations O(1))."""
    torch.manual_seed(seed)
    experts = Experts(hidden, MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=inter), act)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape) / hidden**0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape) / inter**0.5)
    return experts.to(device, dtype).requires_grad_(False)


def routing_inputs(num_tokens, hidden, num_experts, top_k, dtype, device="cpu", seed=1, allowed=None):
    """``x [T, H]``, distinct ids per token (among ``allowed`` experts if given), softmax-like weights."""
    generator = torch.Generator().manual_seed(seed)
    pool = torch.arange(num_experts) if allowed is None else torch.as_tensor(allowed)
    x = torch.randn(num_tokens, hidden, generator=generator).to(device, dtype)
    picks = [pool[torch.randperm(len(pool), generator=generator)[:top_k]] for _ in range(num_tokens)]
    ids = torch.stack(picks) if picks else torch.zeros(0, top_k, dtype=torch.long)
    weights = torch.rand(num_tokens, top_k, generator=generator)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return x, ids.to(device), weights.to(device, dtype)


def assert_close(got, expected, dtype, scale=None):
    """fp32: tight; fp16 / bf16: a few roundings of the intermediates (gate_up, activation, down)."""
    scale = scale if scale is not None else max(expected.double().abs().max().item(), 1e-6)
    rtol, atol = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}[dtype]
    torch.testing.assert_close(got.double(), expected.double(), rtol=rtol, atol=atol * scale)


def test_cpu_kernel_under_the_triton_interpreter(request):
    """Reference / routed_forward agreement, empty experts, T=0, E=128 K=8 (see interpreted_moe_grouped.py)."""
    run_interpreted(Path(__file__).with_name("interpreted_moe_grouped.py"), request)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [(1, 8, 2, 16), (17, 8, 2, 16), (5, 128, 8, 16),
                                                                   (300, 8, 2, 32), (0, 8, 2, 16)])
def test_route_layout(num_tokens, num_experts, top_k, block_m):
    """Every (token, slot) pair has its own row, in its expert's blocks; padding rows read nothing."""
    _, ids, weights = routing_inputs(num_tokens, 4, num_experts, top_k, torch.float32, allowed=range(0, num_experts, 3))
    routing = route(ids, weights, num_experts, block_m)
    # worst-case padding, and never more blocks than pairs (each used block holds at least one)
    num_blocks = min(num_tokens * top_k, -(-(num_tokens * top_k + num_experts * (block_m - 1)) // block_m))
    assert routing.row_token_R.shape == (num_blocks * block_m,) and routing.block_expert_B.shape == (num_blocks,)
    rows = routing.pair_row_TK
    assert rows.shape == (num_tokens, top_k) and len(set(rows.flatten().tolist())) == rows.numel()
    row_expert = routing.block_expert_B.long().repeat_interleave(block_m)
    ids_sorted, slot_order = torch.sort(ids, dim=1, stable=True)
    assert torch.equal(routing.weights_TK, weights.gather(1, slot_order))
    for token in range(num_tokens):
        assert (routing.row_token_R[rows[token]] == token).all()
        assert torch.equal(row_expert[rows[token]], ids_sorted[token])
    assert (routing.row_token_R >= 0).sum().item() == num_tokens * top_k
    used = routing.block_expert_B >= 0
    assert not used[used.sum():].any()  # the used blocks come first
    assert torch.equal(routing.block_expert_B[used], routing.block_expert_B[used].sort().values)


def test_configs():
    assert pick_block_m(8, 64) == 16  # decode: one token, 8 experts
    assert pick_block_m(4096 * 8, 64) == 128
    assert [pick_block_m(t * 8, 64) for t in (1, 64, 256, 1024, 4096)] == sorted(
        pick_block_m(t * 8, 64) for t in (1, 64, 256, 1024, 4096))
    config = gemm_config(16, 768, 1024, torch.bfloat16)
    assert (config.block_m, config.block_n, config.block_k) == (16, 64, 64)
    assert gemm_config(128, 1024, 384, torch.bfloat16).block_n == 128
    assert gemm_config(16, 32, 16, torch.float32).block_n == 32  # tiny shapes: no wider than needed


def test_cpu_without_the_interpreter_takes_the_reference():
    experts = make_experts(32, 16, 8, 2, torch.bfloat16)
    x, ids, weights = routing_inputs(5, 32, 8, 2, torch.bfloat16)
    args = (x, ids, weights, experts.gate_up_proj, experts.down_proj)
    assert torch.equal(grouped_moe_forward(*args), grouped_moe_forward_reference(*args))
    assert grouped_moe_forward(x[:0], ids[:0], weights[:0], *args[3:]).shape == (0, 32)
    with pytest.raises(ValueError, match="down"):
        grouped_moe_forward(x, ids, weights, experts.gate_up_proj, experts.down_proj[:, :, :-1])
    with pytest.raises(ValueError, match="one dtype"):
        grouped_moe_forward(x.float(), ids, weights, experts.gate_up_proj, experts.down_proj)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_reference_matches_routed_forward(act):
    experts = make_experts(32, 16, 8, 2, torch.float64, act=act)
    x, ids, weights = routing_inputs(17, 32, 8, 2, torch.float64)
    expected = routed_forward(x, ids, weights, 8, experts.expert_mlp)
    torch.testing.assert_close(grouped_moe_forward_reference(x, ids, weights, experts.gate_up_proj,
                                                             experts.down_proj, act), expected)


def test_experts_forward_on_cpu_takes_the_loop():
    """Without Triton (plain CPU) ``Experts.forward`` is ``routed_forward`` whatever ``moe_kernel`` says."""
    experts = make_experts(32, 16, 8, 2, torch.float32)
    x, ids, weights = routing_inputs(5, 32, 8, 2, torch.float32)
    expected = routed_forward(x, ids, weights, 8, experts.expert_mlp)
    assert experts.moe_kernel == "fused"
    with torch.no_grad():
        assert torch.equal(experts(x, ids, weights), expected)  # CPU: not the fused path


def test_fused_moe_under_the_triton_interpreter(request):
    """Routing variants through ``MoE.forward``, the one-program routing kernel (see interpreted_moe_fused.py)."""
    run_interpreted(Path(__file__).with_name("interpreted_moe_fused.py"), request)


def test_gpt_oss_experts_under_the_triton_interpreter(request):
    """Expert biases and the clamped SwiGLU in the fused kernels, ``VariantExperts`` on them
    (see interpreted_moe_gpt_oss.py)."""
    run_interpreted(Path(__file__).with_name("interpreted_moe_gpt_oss.py"), request)


def test_fused_activation_choices():
    from miles_host.kernels.moe_grouped import DenseExpertGemms, fuses

    assert fuses("silu") and fuses("clamped_swiglu", 7.0)
    assert not fuses("clamped_swiglu") and not fuses("silu", 7.0) and not fuses("relu")
    experts = make_experts(32, 16, 8, 2, torch.float32)
    with pytest.raises(ValueError, match="swiglu_limit"):
        DenseExpertGemms(experts.gate_up_proj, experts.down_proj, "clamped_swiglu")
    x, ids, weights = routing_inputs(3, 32, 8, 2, torch.float32)
    with pytest.raises(ValueError, match="gate_up bias"):
        grouped_moe_forward(x, ids, weights, experts.gate_up_proj, experts.down_proj,
                            gate_up_bias_E2I=torch.zeros(8, 16))


def test_set_moe_kernel_and_engine_config():
    from miles_host.models.mlp import set_moe_kernel
    from miles_host.rollout.config import EngineConfig

    experts = make_experts(32, 16, 8, 2, torch.float32)
    assert set_moe_kernel(experts, "loop") == 1 and experts.moe_kernel == "loop"
    with pytest.raises(ValueError, match="--moe-kernel"):
        set_moe_kernel(experts, "grouped")
    with pytest.raises(ValueError, match="--moe-kernel"):
        EngineConfig(device=torch.device("cpu"), kv_cache_dtype=torch.float32, max_model_len=64, moe_kernel="x")


def test_tile_table_lookup(monkeypatch):
    from miles_host.kernels import moe_configs

    assert [moe_configs.token_bucket(t) for t in (0, 1, 3, 128, 129, 10**6)] == [1, 1, 4, 128, 256, 8192]
    default = moe_configs.moe_tiles(4, 8, 64, 2048, 768, torch.bfloat16, "bf16")  # not in the table
    assert default == moe_configs.default_tiles(4, 8, 64, 2048, 768, torch.bfloat16)
    monkeypatch.setitem(moe_configs.TUNED, (128, 2048, 768, "bf16"), {1: (16, (32, 128, 4, 3), (64, 64, 4, 4)),
                                                                      256: (32, (64, 64, 4, 3), (128, 64, 8, 3))})
    tiles = moe_configs.moe_tiles(3, 8, 128, 2048, 768, torch.bfloat16, "bf16")  # bucket 4: nearest is 1
    assert tiles.block_m == 16 and tiles.gate_up == moe_configs.GemmConfig(16, 32, 128, 4, 3)
    assert moe_configs.moe_tiles(200, 8, 128, 2048, 768, torch.bfloat16, "bf16").down.block_n == 128
    assert moe_configs.moe_tiles(200, 8, 128, 2048, 768, torch.bfloat16, "fp8_block128") != tiles


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_compiles_for_sm90(dtype):
    """The GPU branches (no interpreter) build for the H200: bf16 on wgmma, fp32 on FMA (never TF32)."""
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra installs it)")
    from miles_host.kernels import _moe_grouped_triton
    from tests.plugins.triton_sm90 import compile_sm90

    pointer = {torch.bfloat16: "*bf16", torch.float32: "*fp32"}[dtype]
    signature = {"A": pointer, "RowToken": "*i64", "BlockExpert": "*i32", "W": pointer, "Bias": pointer,
                 "C": pointer, "N": "i32", "stride_am": "i32", "stride_ak": "constexpr", "stride_we": "i32",
                 "stride_wn": "i32", "stride_wk": "constexpr", "stride_be": "i32", "stride_bn": "constexpr",
                 "stride_cm": "i32", "stride_cn": "constexpr"}
    hidden, inter, num_experts, top_k = QWEN3_MOE
    # plain SwiGLU gate_up (decode), plain down (prefill), gpt-oss' biased clamped gate_up and biased down
    for num_tokens, gated, (n, k), gpt_oss in ((1, True, (inter, hidden), False), (4096, False, (hidden, inter), False),
                                               (64, True, (inter, hidden), True), (64, False, (hidden, inter), True)):
        config = gemm_config(pick_block_m(num_tokens * top_k, num_experts), n, k, dtype)
        constexprs = dict(stride_ak=1, stride_wk=1, stride_bn=1, stride_cn=1, K=k, K_BLOCKS=-(-k // config.block_k),
                          GATHER=gated, GATED=gated, ACT=3 if gpt_oss else 0, HAS_BIAS=gpt_oss,
                          LIMIT=7.0 if gpt_oss else 0.0, ALPHA=1.702 if gpt_oss else 1.0,
                          IEEE=dtype == torch.float32, EMULATE=False,
                          BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k)
        ptx = compile_sm90(_moe_grouped_triton._moe_gemm_kernel, signature, constexprs, config.num_warps,
                           config.num_stages, unaligned=())
        if not gated and dtype == torch.bfloat16:  # the down projection with the combine in its epilogue
            combined = compile_sm90(
                _moe_grouped_triton._moe_gemm_kernel,
                {**signature, "PairRow": "*i64", "Weights": "*fp32", "Y": pointer, "Counters": "*i32",
                 "stride_wt": "i32", "stride_yt": "i32"},
                {**constexprs, "COMBINE": True, "TOP_K": top_k}, config.num_warps, config.num_stages,
                unaligned=("stride_wt",))
            assert re.search(r"atom\.global\.gpu\.acq_rel\.add", combined) and "ld.global.cg" in combined
        assert "tf32" not in ptx, config
        if dtype == torch.bfloat16:
            assert re.search(r"(wgmma|mma)\.\S*bf16", ptx), config
        else:
            assert "fma.rn.f32" in ptx, config
    if dtype == torch.bfloat16:  # the one-pair GEMV (--moe-gemv-tokens): both projections, no spills
        gemv_signature = {"A": pointer, "RowToken": "*i64", "PairRow": "*i64", "BlockExpert": "*i32", "W": pointer,
                          "C": pointer, "N": "i32", "stride_am": "i32", "stride_we": "i32", "stride_wn": "i32",
                          "stride_cm": "i32"}
        for k, gated, block_k, block_n in ((hidden, True, 512, 8), (inter, False, 128, 16)):
            gemv_ptx = compile_sm90(_moe_grouped_triton._moe_gemv_kernel, gemv_signature,
                                    dict(K=k, BLOCK_K=block_k, ROW_BLOCK=16, GATHER=gated, GATED=gated, ACT=0,
                                         EMULATE=False, BLOCK_N=block_n), 4, 1, unaligned=("N",))
            assert ".local" not in gemv_ptx and "ld.global.v4" in gemv_ptx
        combine_signature = {"A": pointer, "PairRow": "*i64", "BlockExpert": "*i32", "Weights": "*fp32", "W": pointer,
                             "Y": pointer, "N": "i32", "stride_am": "i32", "stride_we": "i32", "stride_wn": "i32",
                             "stride_wt": "i32", "stride_yt": "i32"}
        for block_n in (4, 8, 16):  # the down GEMV with the top-k sum: every slot unrolled, still no spills
            combine_ptx = compile_sm90(_moe_grouped_triton._moe_gemv_combine_kernel, combine_signature,
                                       dict(K=inter, BLOCK_K=256, ROW_BLOCK=16, TOP_K=top_k, EMULATE=False,
                                            BLOCK_N=block_n), 4, 1, unaligned=("N", "stride_wt"))
            assert ".local" not in combine_ptx and "ld.global.v4" in combine_ptx


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [1, 64, 256, 4096])
def test_gpu_qwen3_moe_shapes_match_the_reference(num_tokens):
    hidden, inter, num_experts, top_k = QWEN3_MOE
    experts = make_experts(hidden, inter, num_experts, top_k, torch.bfloat16, device="cuda")
    x, ids, weights = routing_inputs(num_tokens, hidden, num_experts, top_k, torch.bfloat16, device="cuda")
    args = (x, ids, weights, experts.gate_up_proj, experts.down_proj)
    with torch.no_grad():
        got = grouped_moe_forward(*args)
        assert_close(got, grouped_moe_forward_reference(*args), torch.bfloat16)
        assert_close(got, routed_forward(x, ids, weights, num_experts, experts.expert_mlp), torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
def test_gpu_gpt_oss_experts_fused_match_the_loop(num_tokens):
    """gpt-oss' experts (biases, clamped SwiGLU at limit 7) in bf16: the fused kernels against the
    float64 reference and against ``VariantExperts``' own per-expert loop; empty experts at T=1."""
    from miles_host.models.moe_variants import VariantExperts

    hidden, inter, num_experts, top_k = 512, 256, 32, 4
    torch.manual_seed(0)
    moe = MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=inter, expert_biases=True,
                    swiglu_limit=7.0, swiglu_alpha=1.702)
    experts = VariantExperts(hidden, moe, "silu")
    with torch.no_grad():  # pre-activations of O(10): the limit clamps a good share of them
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape) * (4.0 if param.dim() == 2 else 10.0 / param.shape[-1] ** 0.5))
    experts = experts.to("cuda", torch.bfloat16).requires_grad_(False)
    x, ids, weights = routing_inputs(num_tokens, hidden, num_experts, top_k, torch.bfloat16, device="cuda")
    extras = dict(gate_up_bias_E2I=experts.gate_up_proj_bias, down_bias_EH=experts.down_proj_bias,
                  swiglu_limit=7.0, swiglu_alpha=1.702)
    args = (x, ids, weights, experts.gate_up_proj, experts.down_proj, "clamped_swiglu")
    with torch.no_grad():
        fused = experts(x, ids, weights)
        assert torch.equal(fused, grouped_moe_forward(*args, **extras))
        experts.moe_kernel = "loop"
        loop = experts(x, ids, weights)
    assert_close(fused, grouped_moe_forward_reference(*args, **extras), torch.bfloat16)
    assert_close(fused, loop, torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_other_dtypes_and_empty_experts(dtype):
    hidden, inter, num_experts, top_k = QWEN3_MOE
    experts = make_experts(hidden, inter, num_experts, top_k, dtype, device="cuda")
    x, ids, weights = routing_inputs(300, hidden, num_experts, top_k, dtype, device="cuda", allowed=range(0, 64, 5))
    args = (x, ids, weights, experts.gate_up_proj, experts.down_proj)
    assert_close(grouped_moe_forward(*args), grouped_moe_forward_reference(*args), dtype)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [1, 32, 256])
def test_gpu_combine_in_the_down_epilogue_gives_the_same_bits(num_tokens):
    """``--moe-combine epilogue`` at the Qwen3-MoE shape, eagerly and replayed in a CUDA graph with new
    inputs: the separate combine's bits."""
    from miles_host.kernels import switches

    hidden, inter, num_experts, top_k = QWEN3_MOE
    experts = make_experts(hidden, inter, num_experts, top_k, torch.bfloat16, device="cuda")
    static = routing_inputs(num_tokens, hidden, num_experts, top_k, torch.bfloat16, device="cuda", seed=1)
    weights_args = (experts.gate_up_proj, experts.down_proj)
    with torch.no_grad(), switches.switched(moe_combine="epilogue"):
        assert torch.equal(grouped_moe_forward(*static, *weights_args),
                           _separate(grouped_moe_forward, static, weights_args))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = grouped_moe_forward(*static, *weights_args)
        for seed in (2, 3):
            fresh = routing_inputs(num_tokens, hidden, num_experts, top_k, torch.bfloat16, device="cuda", seed=seed)
            for dst, src in zip(static, fresh):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static_y, _separate(grouped_moe_forward, fresh, weights_args)), seed


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_gpu_one_pair_gemv_matches_the_reference(num_tokens):
    """``--moe-gemv-tokens`` at the Qwen3-MoE shape: within the grouped path's tolerance of float64, eagerly
    and replayed in a CUDA graph."""
    from miles_host.kernels import switches

    hidden, inter, num_experts, top_k = QWEN3_MOE
    experts = make_experts(hidden, inter, num_experts, top_k, torch.bfloat16, device="cuda")
    inputs = routing_inputs(num_tokens, hidden, num_experts, top_k, torch.bfloat16, device="cuda", seed=1)
    weights_args = (experts.gate_up_proj, experts.down_proj)
    with torch.no_grad(), switches.switched(moe_gemv_tokens=4):
        got = grouped_moe_forward(*inputs, *weights_args)
        assert_close(got, grouped_moe_forward_reference(*inputs, *weights_args), torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = grouped_moe_forward(*inputs, *weights_args)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, got)
        with switches.switched(moe_combine="epilogue"):  # the down GEMV with the top-k sum: the same bits
            assert torch.equal(grouped_moe_forward(*inputs, *weights_args), got)


def _separate(forward, inputs, weights_args):
    from miles_host.kernels import switches

    with switches.switched(moe_combine="separate"):
        return forward(*inputs, *weights_args)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_gpu_cuda_graph_capture_and_replay(num_tokens):
    """Captured once, replayed with new x / ids / weights copied into the static inputs: equal to eager."""
    hidden, inter, num_experts, top_k = QWEN3_MOE
    experts = make_experts(hidden, inter, num_experts, top_k, torch.bfloat16, device="cuda")
    static = routing_inputs(num_tokens, hidden, num_experts, top_k, torch.bfloat16, device="cuda", seed=1)
    weights_args = (experts.gate_up_proj, experts.down_proj)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (Triton compiles) outside the capture
            grouped_moe_forward(*static, *weights_args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = grouped_moe_forward(*static, *weights_args)
        for seed in (2, 3, 4):
            fresh = routing_inputs(num_tokens, hidden, num_experts, top_k, torch.bfloat16, device="cuda", seed=seed)
            for dst, src in zip(static, fresh):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static_y, grouped_moe_forward(*fresh, *weights_args)), seed


@pytest.mark.gpu
@requires_cuda
def test_gpu_experts_forward_is_fused_by_default():
    hidden, inter, num_experts, top_k = QWEN3_MOE
    experts = make_experts(hidden, inter, num_experts, top_k, torch.bfloat16, device="cuda")
    x, ids, weights = routing_inputs(64, hidden, num_experts, top_k, torch.bfloat16, device="cuda")
    with torch.no_grad():
        assert torch.equal(experts(x, ids, weights), grouped_moe_forward(x, ids, weights, experts.gate_up_proj,
                                                                         experts.down_proj))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [1, 37, 512, 600])
def test_gpu_route_kernel_is_the_torch_layout(num_tokens):
    """The one-program routing kernel (up to 4096 pairs) against ``route`` on the GPU."""
    from miles_host.kernels.moe_grouped import plan

    _, ids, weights = routing_inputs(num_tokens, 4, 128, 8, torch.bfloat16, device="cuda")
    for block_m in (16, 64):
        got, expected = plan(ids, weights, 128, block_m), route(ids, weights, 128, block_m)
        assert torch.equal(got.row_token_R, expected.row_token_R)
        assert torch.equal(got.block_expert_B, expected.block_expert_B)
        assert torch.equal(got.row_token_R[got.pair_row_TK],
                           torch.arange(num_tokens, device="cuda")[:, None].expand(-1, 8))


@pytest.mark.gpu
@requires_cuda
def test_gpu_decode_graphs_capture_the_fused_path(monkeypatch):
    """The engine captures its decode graphs without autograd, so the fused MoE (an inference path) is in them."""
    from bench.moe_models import build_model
    from miles_host.kernels import moe_grouped
    from miles_host.rollout import Engine

    calls = []
    original = moe_grouped.fused_moe
    monkeypatch.setattr(moe_grouped, "fused_moe", lambda *a, **k: calls.append(torch.is_grad_enabled()) or original(*a, **k))
    engine = Engine(build_model("tiny", torch.bfloat16, "cuda"), tokenizer=None, max_num_seqs=4, max_model_len=64,
                    max_kv_cache_tokens=4096)
    assert engine.runner.graphs is not None and calls and not any(calls)
