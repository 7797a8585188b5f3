"""Random packed micro-batches for the algorithm tests (float64, numpy-backed)."""

from __future__ import annotations

import numpy as np
import pytest


class PackedBatch:
    """Random per-token arrays over sequences of unequal lengths, with holes in the mask."""

    def __init__(self, rng: np.random.Generator, lengths: list[int], spread: float = 0.4):
        self.lengths = lengths
        n = sum(lengths)
        self.log_probs = -np.abs(rng.normal(size=n)) - 0.05
        self.old_log_probs = self.log_probs + spread * rng.normal(size=n)
        self.old_log_probs[::4] -= 1.3  # a few far-off-policy tokens (ratio > 3) for the dual clip
        self.rollout_log_probs = self.old_log_probs + spread * rng.normal(size=n)
        self.ref_log_probs = self.log_probs + spread * rng.normal(size=n)
        self.advantages = rng.normal(size=n)
        self.entropy = np.abs(rng.normal(size=n))
        self.loss_mask = (rng.random(n) > 0.25).astype(np.float64)
        for start, length in zip(self.starts(), lengths):  # every sequence keeps a token
            self.loss_mask[start + length - 1 if length % 2 else start] = 1.0

    def starts(self) -> list[int]:
        return list(np.cumsum([0] + self.lengths[:-1]))

    def segments(self):
        """Yield ``slice`` objects, one per sequence."""
        for start, length in zip(self.starts(), self.lengths):
            yield slice(start, start + length)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
def packed(rng) -> PackedBatch:
    return PackedBatch(rng, [5, 1, 9, 3, 12, 7])
