"""Captured MoE routes (R3) kept per KV-cache slot, as SGLang keeps them.

A forward's routes ``[T, L, K]`` are written at the cache slots its tokens' K/V went to
(one vectorized write per forward, whatever the batch size), and blocks are copied where
the KV cache copies them (copy-on-write), so the store mirrors the cache: the routes of
a sequence are the rows at the slots of its block table, read once when it finishes
(:meth:`RouteStore.gather`). A sequence that gives up its blocks unfinished (preemption)
keeps what they held in ``Sequence.routed_expert_chunks`` first.

The array is allocated at the first write (``[slots, L, K]`` int32, zero pages
untouched until used), so an engine that never captures holds none.

Tensor legend: S = cache slots (blocks x block size), T = tokens of a forward,
L = MoE layers, K = experts per token.
"""

from __future__ import annotations

import numpy as np
import torch


class RouteStore:
    """Expert ids of the token at every KV-cache slot."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.rows_SLK: np.ndarray | None = None

    def write(self, slots_T: np.ndarray, routes_TLK: np.ndarray, skip_rows: list[int] | None = None) -> None:
        """Store row ``t`` of ``routes_TLK`` at slot ``slots_T[t]``, except rows ``skip_rows``."""
        if skip_rows:
            keep_T = np.ones(len(slots_T), dtype=bool)
            keep_T[skip_rows] = False
            slots_T, routes_TLK = slots_T[keep_T], routes_TLK[keep_T]
        if self.rows_SLK is None:
            self.rows_SLK = np.zeros((self.num_blocks * self.block_size, *routes_TLK.shape[1:]), dtype=np.int32)
        self.rows_SLK[slots_T] = routes_TLK

    def write_positions(self, block_table: list[int], start: int, routes_TLK) -> None:
        """Store the routes of a sequence's positions ``start, start + 1, ...`` (rows past
        its blocks are dropped); ``routes_TLK`` is a numpy array or a tensor."""
        if isinstance(routes_TLK, torch.Tensor):
            routes_TLK = routes_TLK.cpu().numpy()
        positions_T = np.arange(start, min(start + routes_TLK.shape[0], len(block_table) * self.block_size))
        self.write(self._slots(block_table, positions_T), routes_TLK[:len(positions_T)])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``(source, destination)``, as the KV cache does."""
        if self.rows_SLK is None or not pairs:
            return
        blocks = self.rows_SLK.reshape(self.num_blocks, self.block_size, *self.rows_SLK.shape[1:])
        source, destination = zip(*pairs)
        blocks[list(destination)] = blocks[list(source)]

    def gather(self, block_table: list[int], num_rows: int) -> np.ndarray | None:
        """``[num_rows, L, K]`` int32: the rows of positions ``0 .. num_rows - 1`` of the
        sequence holding ``block_table`` (a copy); None when nothing was ever stored."""
        if self.rows_SLK is None:
            return None
        blocks = self.rows_SLK.reshape(self.num_blocks, self.block_size, *self.rows_SLK.shape[1:])
        used = (num_rows + self.block_size - 1) // self.block_size
        return blocks[block_table[:used]].reshape(-1, *self.rows_SLK.shape[1:])[:num_rows]

    def _slots(self, block_table: list[int], positions_T: np.ndarray) -> np.ndarray:
        table = np.asarray(block_table, dtype=np.int64)
        return table[positions_T // self.block_size] * self.block_size + positions_T % self.block_size
