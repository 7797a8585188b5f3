"""CPU tests of :mod:`miles_host.kernels.invariant_reduce` under Triton's interpreter (not collected by itself).

Run by ``test_invariant_reduce.py::test_cpu_kernels_under_the_triton_interpreter``
in a fresh process with ``TRITON_INTERPRET=1``; alone:
``TRITON_INTERPRET=1 python -m pytest tests/kernels/interpreted_invariant_reduce.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_invariant_reduce import (
    assert_log_probs_close, assert_log_probs_invariant, assert_mean_close, logits_and_targets, rows,
)
from tests.plugins.triton_interpret import interpreted_module

BATCHES = (1, 3, 17, 64)


@pytest.fixture(scope="module")
def kernels():
    return interpreted_module("miles_host.kernels.invariant_reduce")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("length", [1, 64, 100, 5000])  # one chunk, a tail, several 4096 chunks
def test_row_mean_accurate_and_invariant(kernels, length, dtype):
    x = rows(70, length, dtype)
    full = kernels.invariant_row_mean(x, -1, keepdim=True)
    assert_mean_close(full, x, keepdim=True)
    for t in BATCHES:
        assert torch.equal(kernels.invariant_row_mean(x[:t], [-1], keepdim=True), full[:t])
        assert torch.equal(kernels.invariant_row_mean(x[-t:], 1, keepdim=True), full[-t:])


def test_row_mean_shapes_strides_and_dtypes(kernels):
    x = rows(24, 40, torch.bfloat16)
    expected = kernels.invariant_row_mean(x, -1)
    assert torch.equal(kernels.invariant_row_mean(x.reshape(2, 3, 4, 40), 3).reshape(-1), expected)
    assert torch.equal(kernels.invariant_row_mean(x.t().contiguous().t(), -1), expected)  # copied to rows
    wide = torch.zeros(24, 100, dtype=torch.bfloat16)
    wide[:, 30:70] = x
    assert torch.equal(kernels.invariant_row_mean(wide[:, 30:70], -1), expected)  # row stride 100
    assert_mean_close(kernels.invariant_row_mean(x, -1, dtype=torch.float32), x, dtype=torch.float32)
    assert kernels.invariant_row_mean(x[:0], -1).shape == (0,)
    assert kernels.invariant_row_mean(x[:, :0], -1, keepdim=True).isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [50, 4096, 9000])  # V < chunk, V = chunk, V not a multiple of it
def test_log_probs_accurate_and_invariant(kernels, vocab, dtype):
    logits, targets = logits_and_targets(20, vocab, dtype)
    for options in (dict(), dict(temperature=0.7, logit_softcap=30.0)):
        assert_log_probs_close(logits, targets, **options)
        assert_log_probs_invariant(logits, targets, (1, 3, 17), **options)


def test_log_probs_strided_logits_and_bad_targets(kernels):
    logits, targets = logits_and_targets(6, 300, torch.float32)
    expected, _ = kernels.invariant_log_probs(logits, targets)
    wide = torch.zeros(6, 700)
    wide[:, 100:400] = logits
    assert torch.equal(kernels.invariant_log_probs(wide[:, 100:400], targets)[0], expected)
    strided = torch.zeros(6, 600)
    strided[:, ::2] = logits
    assert torch.equal(kernels.invariant_log_probs(strided[:, ::2], targets)[0], expected)
    targets[2], targets[4] = -100, 300
    got, _ = kernels.invariant_log_probs(logits, targets)
    assert got[[2, 4]].isnan().all() and torch.equal(got[[0, 1, 3, 5]], expected[[0, 1, 3, 5]])
