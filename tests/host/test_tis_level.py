"""--tis-level: the level of the truncated importance-sampling ratio, against float64 formulas."""

from __future__ import annotations

import math

import pytest
import torch

from miles_host.algorithms.corrections import tis_correction
from miles_host.config import MilesConfig

TRAIN = [-1.0, -0.5, -2.0, -0.1, -0.3]
ROLLOUT = [-1.2, -0.4, -1.0, -0.2, -0.3]
MASK = [1.0, 1.0, 0.0, 1.0, 1.0]
LENGTHS = [3, 2]


def _expected(level, low, high):
    out = []
    start = 0
    for n in LENGTHS:
        diffs = [TRAIN[i] - ROLLOUT[i] for i in range(start, start + n)]
        kept = [d for d, m in zip(diffs, MASK[start:start + n]) if m]
        for d in diffs:
            value = {"token": d, "sequence": sum(kept), "geometric": sum(kept) / len(kept)}[level]
            out.append(min(max(math.exp(value), low), high))
        start += n
    return out


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_levels(level):
    config = MilesConfig(use_tis=True, tis_level=level, tis_clip=1.5, tis_clip_low=0.2)
    result = tis_correction(torch.tensor(TRAIN, dtype=torch.float64), torch.tensor(ROLLOUT, dtype=torch.float64),
                            torch.tensor(MASK, dtype=torch.float64), LENGTHS, config)
    assert result.weights.tolist() == pytest.approx(_expected(level, 0.2, 1.5))


def test_a_level_without_tis_is_an_error():
    with pytest.raises(ValueError, match="--use-tis"):
        MilesConfig(tis_level="geometric")
