"""Where a paged-attention step's tokens live in the KV cache (the kernels' and the engine's
common description of a step).

Tensor legend: T = tokens of the step (flattened over sequences), B = sequences, M = max
blocks per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Where a step's tokens live in the cache and which context each one sees.

    ``cu_seqlens_q``: [B + 1] offsets of each sequence's new tokens in the step;
    ``context_lens``: [B] cached + new tokens of each sequence; ``block_tables``:
    [B, M] block ids (int32); ``slot_mapping``: [T] cache slot of each new token.
    ``tile_seq``/``tile_q_start`` (Triton only): which sequence and first token each
    query tile of the kernel covers.
    """

    slot_mapping_T: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens_B: torch.Tensor
    block_tables_BM: torch.Tensor
    max_q_len: int
    max_context_len: int
    is_decode: bool
    tile_seq: torch.Tensor | None = None
    tile_q_start: torch.Tensor | None = None
    # Host copies for the reference path (avoid a device sync per layer).
    cu_seqlens_q_host: list[int] | None = None
    context_lens_host: list[int] | None = None
    # [T] int64 cache slots on the host (where route capture stores each token's experts)
    slot_mapping_host: Any = None
