"""The paged-attention reference against the models' dense attention."""

from __future__ import annotations

import pytest
import torch

from miles_host.models.attention import attend_dense
from miles_host.rollout.attention import paged_attention_reference


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
