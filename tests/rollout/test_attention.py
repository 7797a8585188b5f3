"""The paged-attention reference against the models' dense attention."""

from __future__ import annotations

import pytest
import torch

from miles_host.models.attention import attend_dense
from miles_host.rollout.attention import merge_attention_states, paged_attention_reference


def paged_case(lengths_new, lengths_ctx, heads_q=4, heads_kv=2, dim=16, dim_v=16, block_size=4, seed=0,
               dtype=torch.float32, device="cpu"):
    """Random contexts scattered over shuffled blocks, plus dense copies for the oracle."""
    g = torch.Generator().manual_seed(seed)
    total_blocks = sum((c + block_size - 1) // block_size for c in lengths_ctx) + 1
    k_cache = torch.randn(total_blocks, block_size, heads_kv, dim, generator=g).to(device, dtype)
    v_cache = torch.randn(total_blocks, block_size, heads_kv, dim_v, generator=g).to(device, dtype)
    order = (torch.randperm(total_blocks - 1, generator=g) + 1).tolist()
    width = max((c + block_size - 1) // block_size for c in lengths_ctx)
    tables, cursor = [], 0
    for c in lengths_ctx:
        need = (c + block_size - 1) // block_size
        tables.append(order[cursor:cursor + need] + [0] * (width - need))
        cursor += need
    q = torch.randn(sum(lengths_new), heads_q, dim, generator=g).to(device, dtype)
    cu = [0]
    for n in lengths_new:
        cu.append(cu[-1] + n)
    return q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32, device=device), cu


@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 20.0)])
def test_reference_matches_dense_attention(window, softcap):
    lengths_new, lengths_ctx = [3, 1, 7, 1], [9, 6, 7, 13]
    q, k_cache, v_cache, tables, cu = paged_case(lengths_new, lengths_ctx)
    out = paged_attention_reference(q, k_cache, v_cache, tables, cu, lengths_ctx, scale=0.25,
                                    sliding_window=window, logit_softcap=softcap)
    for b, (n, c) in enumerate(zip(lengths_new, lengths_ctx)):
        blocks = tables[b, : (c + 3) // 4].long()
        k = k_cache[blocks].flatten(0, 1)[:c].transpose(0, 1)[None]
        v = v_cache[blocks].flatten(0, 1)[:c].transpose(0, 1)[None]
        expected = attend_dense(q[cu[b]:cu[b + 1]].transpose(0, 1)[None], k, v, scale=0.25, query_offset=c - n,
                                sliding_window=window, logit_softcap=softcap)
        torch.testing.assert_close(out[cu[b]:cu[b + 1]], expected[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_fused_attention_block_stores_kv_itself_and_matches_the_eager_block(qwen3_dense):
    """The fused decode form of a GQA block (keys and values stored by the q/k norm + rotary step,
    ``attend(kv_stored=True)``) leaves the same cache and output as the eager block (CPU: the
    references of the fused kernels)."""
    from miles_host.kernels.attention_metadata import AttentionMetadata
    from miles_host.rollout.attention import PagedAttention
    from miles_host.rollout.kv_cache import PagedKVCache
    from tests.rollout.conftest import load

    model = load(qwen3_dense[1])
    block = model.layers[0].attn
    lengths_ctx, block_size = [6, 11], 4
    positions = torch.tensor([c - 1 for c in lengths_ctx])
    cos_sin = model._rope_tables(positions, torch.float32)[id(model.config.rope_of(0))]
    x = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    results = []
    for form in (block.forward, block.forward_fused):
        cache = PagedKVCache(model.attention_layout(), num_blocks=8, block_size=block_size, dtype=torch.float32,
                             device="cpu")
        torch.manual_seed(0)
        for k_NSHD, v_NSHD in zip(cache.k_NSHD, cache.v_NSHD):
            k_NSHD.normal_()
            v_NSHD.normal_()
        tables = torch.tensor([[1, 2, 0], [3, 4, 5]], dtype=torch.int32)
        slots = [int(tables[b, (c - 1) // block_size]) * block_size + (c - 1) % block_size
                 for b, c in enumerate(lengths_ctx)]
        meta = AttentionMetadata(
            slot_mapping_T=torch.tensor(slots), cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
            context_lens_B=torch.tensor(lengths_ctx, dtype=torch.int32), block_tables_BM=tables, max_q_len=1,
            max_context_len=max(lengths_ctx), is_decode=True, cu_seqlens_q_host=[0, 1, 2],
            context_lens_host=lengths_ctx,
        )
        with torch.inference_mode():
            out = form(x, cos_sin, PagedAttention(cache, meta, "torch"))
        results.append((out, cache.k_NSHD[0].clone(), cache.v_NSHD[0].clone()))
    for eager, fused in zip(*results):
        assert torch.equal(eager, fused)


def test_attention_over_key_parts_merged_by_log_sum_exp_is_attention_over_the_whole_context():
    """Each part of the keys with its rows' log-sum-exps, merged, against the whole context in float64
    (parts that start mid-page, a part a query's position does not reach: zeros and -inf)."""
    lengths_new, lengths_ctx = [5, 1, 11], [13, 9, 11]
    q, k_cache, v_cache, tables, cu = paged_case(lengths_new, lengths_ctx, dtype=torch.float64)
    whole, whole_lse = paged_attention_reference(q, k_cache, v_cache, tables, cu, lengths_ctx, scale=0.25,
                                                 return_lse=True)
    parts = [paged_attention_reference(q, k_cache, v_cache, tables, cu, lengths_ctx, scale=0.25, key_range=keys,
                                       return_lse=True) for keys in ((0, 3), (3, 10), (10, 13))]
    torch.testing.assert_close(merge_attention_states(*zip(*parts)), whole, atol=1e-12, rtol=1e-12)
    early_query = cu[2]  # sequence 2's first query (position 0) sees no key past position 0
    assert parts[2][1][early_query].isneginf().all() and (parts[2][0][early_query] == 0).all()
    scores = torch.einsum("hd,lhd->hl", q[0], k_cache[tables[0, :3].long()].flatten(0, 1)[:9].repeat_interleave(2, 1))
    torch.testing.assert_close(whole_lse[0], torch.logsumexp(scores * 0.25, dim=-1), atol=1e-12, rtol=1e-12)
