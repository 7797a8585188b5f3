"""GPU: the Triton paged-attention kernel against the PyTorch reference; the engine on CUDA."""

from __future__ import annotations

import pytest
import torch

from miles_host.rollout.attention import AttentionMetadata, paged_attention_reference
from tests.rollout.test_attention import paged_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _metadata(tables, cu, lengths_ctx, is_decode, heads_q, heads_kv):
    from miles_host.kernels.paged_attention import build_tiles, tokens_per_tile

    device = tables.device
    meta = AttentionMetadata(
        slot_mapping_T=torch.zeros(cu[-1], dtype=torch.long, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens_B=torch.tensor(lengths_ctx, dtype=torch.int32, device=device),
        block_tables_BM=tables,
        max_q_len=max(b - a for a, b in zip(cu, cu[1:])),
        max_context_len=max(lengths_ctx),
        is_decode=is_decode,
    )
    meta.tile_seq, meta.tile_q_start = build_tiles(cu, tokens_per_tile(heads_q, heads_kv, is_decode), device)
    return meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads_q, heads_kv, dim", [(4, 4, 64), (16, 8, 128), (8, 2, 128), (12, 4, 64)])
@pytest.mark.parametrize("window, softcap", [(None, None), (37, None), (None, 30.0)])
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_triton_kernel_matches_reference(dtype, heads_q, heads_kv, dim, window, softcap, mode):
    from miles_host.kernels.paged_attention import paged_attention_triton

    if mode == "decode":
        lengths_ctx = [1, 17, 300, 64, 129, 1000]
        lengths_new = [1] * len(lengths_ctx)
    else:
        lengths_ctx = [5, 200, 64, 333, 90]
        lengths_new = [5, 150, 64, 1, 33]
    q, k_cache, v_cache, tables, cu = paged_case(
        lengths_new, lengths_ctx, heads_q, heads_kv, dim, dim, block_size=16, dtype=dtype, device="cuda"
    )
    meta = _metadata(tables, cu, lengths_ctx, mode == "decode", heads_q, heads_kv)
    scale = dim ** -0.5
    out = paged_attention_triton(q, k_cache, v_cache, meta, scale=scale, sliding_window=window, logit_softcap=softcap)
    ref = paged_attention_reference(q, k_cache, v_cache, tables, cu, lengths_ctx, scale=scale,
                                    sliding_window=window, logit_softcap=softcap)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(out.float(), ref.float(), atol=tolerance, rtol=tolerance)


def test_engine_on_cuda_matches_transformers_greedy(qwen3_dense):
    from tests.rollout.conftest import PROMPTS, engine_logprobs, hf_logprobs, load
    from miles_host.rollout import Engine

    hf_model, path = qwen3_dense
    model = load(path).cuda()
    engine = Engine(model, max_num_seqs=8, mem_fraction_static=0.3, max_kv_cache_tokens=8192)
    assert engine.config.attention_backend in ("triton", "flash_attn")
    assert engine.runner.graphs, "CUDA graphs were not captured"
    outputs = engine.generate(PROMPTS, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
    for prompt, output in zip(PROMPTS, outputs):
        reference = hf_logprobs(hf_model, prompt, output["output_ids"])
        assert (engine_logprobs(output) - reference).abs().max() <= 1e-4


# ----------------------------------------------------------------------------- split-KV decode, KV write

DECODE_SHAPE = dict(heads_q=32, heads_kv=8, dim=128)  # Qwen3-8B


def _decode_case(lengths_ctx, seed=0):
    heads_q, heads_kv, dim = DECODE_SHAPE["heads_q"], DECODE_SHAPE["heads_kv"], DECODE_SHAPE["dim"]
    q, k_cache, v_cache, tables, cu = paged_case(
        [1] * len(lengths_ctx), lengths_ctx, heads_q, heads_kv, dim, dim, block_size=16, seed=seed,
        dtype=torch.bfloat16, device="cuda",
    )
    return q, k_cache, v_cache, tables, cu, _metadata(tables, cu, lengths_ctx, True, heads_q, heads_kv)


@pytest.mark.parametrize("lengths_ctx", [[1], [17], [300], [2000], [1, 17, 300, 2000, 64, 129, 1000, 5]])
@pytest.mark.parametrize("window, softcap", [(None, None), (37, None), (None, 30.0)])
def test_split_decode_matches_reference(lengths_ctx, window, softcap):
    from miles_host.kernels.paged_attention import decode_splits, paged_attention_triton

    q, k_cache, v_cache, tables, cu, meta = _decode_case(lengths_ctx)
    splits = decode_splits(len(lengths_ctx), DECODE_SHAPE["heads_kv"], q.device)
    assert splits > 1, "batch 1 and 8 of 8 KV heads split on an H100/H200"
    scale = DECODE_SHAPE["dim"] ** -0.5
    kwargs = dict(scale=scale, sliding_window=window, logit_softcap=softcap)
    out = paged_attention_triton(q, k_cache, v_cache, meta, **kwargs)
    ref = paged_attention_reference(q, k_cache, v_cache, tables, cu, lengths_ctx, **kwargs)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(paged_attention_triton(q, k_cache, v_cache, meta, **kwargs), out), "deterministic"
    unsplit = paged_attention_triton(q, k_cache, v_cache, meta, splits=1, **kwargs)
    torch.testing.assert_close(out.float(), unsplit.float(), atol=2e-2, rtol=2e-2)
    for other in (2, 16):
        torch.testing.assert_close(paged_attention_triton(q, k_cache, v_cache, meta, splits=other, **kwargs).float(),
                                   ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("batch", [1, 8])
def test_split_decode_in_a_cuda_graph_replayed_with_growing_contexts(batch):
    """One capture (SPLITS fixed by the grid) replayed as the contexts grow: equal to eager launches."""
    from miles_host.kernels.paged_attention import paged_attention_triton

    q, k_cache, v_cache, tables, cu, meta = _decode_case([2000] * batch, seed=1)
    scale = DECODE_SHAPE["dim"] ** -0.5
    meta.context_lens_B.fill_(1)
    paged_attention_triton(q, k_cache, v_cache, meta, scale=scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(q, k_cache, v_cache, meta, scale=scale)
    for context in (1, 17, 300, 301, 1023, 2000):
        lengths = [max(1, context - 7 * b) for b in range(batch)]
        meta.context_lens_B.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        eager = paged_attention_triton(q, k_cache, v_cache, meta, scale=scale)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), context
        ref = paged_attention_reference(q, k_cache, v_cache, tables, cu, lengths, scale=scale)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("src, cache", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                        (torch.float16, torch.bfloat16), (torch.float32, torch.float16),
                                        (torch.float32, torch.float32)])
@pytest.mark.parametrize("num_tokens", [1, 8, 333])
def test_fused_kv_write_is_index_copy_bitwise(src, cache, num_tokens):
    from miles_host.kernels.paged_attention import write_kv_cache

    heads, dim, dim_v, num_blocks, page = 8, 128, 64, 64, 16
    g = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, heads * (2 * dim + dim_v), generator=g) * 4
    qkv[0, heads * dim:heads * dim + 8] = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), 1 + 2 ** -8, 1 + 3 * 2 ** -8, 3.4e38, 1e-40])
    qkv = qkv.to("cuda", src)
    k = qkv[:, heads * dim:2 * heads * dim].view(num_tokens, heads, dim)  # strided, as sliced from qkv
    v = qkv[:, 2 * heads * dim:].view(num_tokens, heads, dim_v)
    slots = torch.randperm(num_blocks * page, generator=g)[:num_tokens].cuda()
    k_cache = torch.randn(num_blocks, page, heads, dim, generator=g).to("cuda", cache)
    v_cache = torch.randn(num_blocks, page, heads, dim_v, generator=g).to("cuda", cache)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    k_expected.view(-1, heads, dim).index_copy_(0, slots, k.to(cache))
    v_expected.view(-1, heads, dim_v).index_copy_(0, slots, v.to(cache))
    write_kv_cache(k_cache, v_cache, k, v, slots)
    assert torch.equal(_bits(k_cache), _bits(k_expected))
    assert torch.equal(_bits(v_cache), _bits(v_expected))


def test_paged_attention_writes_the_cache_with_the_fused_kernel(monkeypatch):
    """The triton backends store K/V through write_kv_cache on CUDA: same cache as index_copy_."""
    from miles_host.kernels import paged_attention as triton_attention
    from miles_host.rollout.attention import PagedAttention
    from miles_host.rollout.kv_cache import PagedKVCache

    calls = []
    original = triton_attention.write_kv_cache
    monkeypatch.setattr(triton_attention, "write_kv_cache", lambda *a: calls.append(1) or original(*a))
    lengths_ctx = [40, 7]
    caches = {}
    for backend in ("torch", "triton"):
        cache = PagedKVCache([(2, 64, 64, None)], num_blocks=8, block_size=16, dtype=torch.bfloat16, device="cuda")
        torch.manual_seed(0)
        q = torch.randn(2, 8, 64, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn(2, 2, 2, 64, device="cuda").unbind(1)
        tables = torch.tensor([[1, 2, 3], [4, 0, 0]], dtype=torch.int32, device="cuda")
        meta = _metadata(tables, [0, 1, 2], lengths_ctx, True, 8, 2)
        meta.slot_mapping_T = torch.tensor([3 * 16 + 7, 4 * 16 + 6], device="cuda")
        meta.cu_seqlens_q_host, meta.context_lens_host = [0, 1, 2], lengths_ctx
        PagedAttention(cache, meta, backend).attend(0, q, k, v, scale=0.125)
        caches[backend] = (cache.k_NSHD[0], cache.v_NSHD[0])
    assert calls == [1]
    assert torch.equal(_bits(caches["torch"][0]), _bits(caches["triton"][0]))
    assert torch.equal(_bits(caches["torch"][1]), _bits(caches["triton"][1]))
