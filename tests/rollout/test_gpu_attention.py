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
    from miles_host.rollout.triton_attention import build_tiles, tokens_per_tile

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
    from miles_host.rollout.triton_attention import paged_attention_triton

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
