"""``routed_experts_array``: a sequence's captured routes in SGLang's layout, rows placed in
capture order (a later capture of a row, after a preemption, overwrites the earlier one)."""

from __future__ import annotations

import numpy as np
import torch

from miles_host.rollout.outputs import routed_experts_array


class _Captured:
    """What ``routed_experts_array`` reads of a sequence: its length and its route chunks."""

    def __init__(self, length: int, chunks: list):
        self.length, self.routed_expert_chunks = length, chunks

    def __len__(self) -> int:
        return self.length


def _row_by_row(seq: _Captured) -> np.ndarray:
    """Each chunk's rows written in order, one row at a time (rows past the last forwarded token dropped)."""
    num_rows = len(seq) - 1
    out = np.zeros((num_rows, *np.asarray(seq.routed_expert_chunks[0][1]).shape[1:]), dtype=np.int32)
    for start, chunk in seq.routed_expert_chunks:
        for offset, row in enumerate(np.asarray(chunk)):
            if start + offset < num_rows:
                out[start + offset] = row
    return out


def test_rows_land_in_capture_order_whatever_the_chunks():
    rng = np.random.default_rng(0)
    for _ in range(200):
        length = int(rng.integers(2, 40))
        chunks = []
        for _ in range(int(rng.integers(1, 10))):
            start, rows = int(rng.integers(0, length)), int(rng.integers(1, 6))
            chunk = rng.integers(0, 64, (rows, 3, 2)).astype(np.int32)
            chunks.append((start, torch.from_numpy(chunk) if rng.random() < 0.3 else chunk))
            for step in range(int(rng.integers(0, 4))):  # decode steps continuing it, one row each
                chunks.append((start + rows + step, rng.integers(0, 64, (1, 3, 2)).astype(np.int32)))
        seq = _Captured(length, chunks)
        assert np.array_equal(routed_experts_array(seq), _row_by_row(seq))


def test_no_capture_gives_none():
    assert routed_experts_array(_Captured(5, [])) is None
