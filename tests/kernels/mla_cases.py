"""Latent MLA attention cases shared by the CPU (interpreter) and GPU tests of
:mod:`miles_host.kernels.mla_attention`: a latent paged cache and its oracle."""

from __future__ import annotations

import torch

from miles_host.kernels.attention_metadata import AttentionMetadata
from miles_host.rollout.attention import paged_attention_reference
from tests.rollout.test_attention import paged_case


def latent_case(lengths_new, lengths_ctx, heads, rank, rope, *, page=16, dtype=torch.float32, device="cpu", seed=0,
                is_decode=None):
    """``(q_latent [T, N, R], q_rope [T, N, P], cache [X, S, R + P], meta, reference)``."""
    from miles_host.kernels.paged_attention import build_tiles, tokens_per_tile

    q, cache, _, tables, cu = paged_case(lengths_new, lengths_ctx, heads, 1, rank + rope, 1, block_size=page,
                                         dtype=dtype, device=device, seed=seed)
    if is_decode is None:
        is_decode = all(n == 1 for n in lengths_new)
    meta = AttentionMetadata(
        slot_mapping_T=torch.zeros(cu[-1], dtype=torch.long, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens_B=torch.tensor(lengths_ctx, dtype=torch.int32, device=device),
        block_tables_BM=tables, max_q_len=max(lengths_new), max_context_len=max(lengths_ctx),
        is_decode=is_decode, cu_seqlens_q_host=cu, context_lens_host=list(lengths_ctx),
    )
    meta.tile_seq, meta.tile_q_start = build_tiles(cu, tokens_per_tile(heads, 1, is_decode), device)
    scale = (rank + rope) ** -0.5
    reference = paged_attention_reference(q, cache, cache[..., :rank], tables, cu, list(lengths_ctx), scale=scale)
    return q[..., :rank], q[..., rank:], cache[:, :, 0], meta, scale, reference
