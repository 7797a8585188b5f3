"""CPU tests of :mod:`miles_host.kernels.mla_attention` under Triton's interpreter (not collected
by itself): run by ``test_mla_attention.py::test_cpu_kernel_under_the_triton_interpreter``; alone:
``TRITON_INTERPRET=1 python -m pytest tests/kernels/interpreted_mla_attention.py``. Float32
operands (the interpreter's ``dot`` reads bfloat16 as raw integers)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.mla_cases import latent_case
from tests.plugins.triton_interpret import interpreted_module
from tests.rollout.interpreted_triton_attention import _scalar_loop_bounds, counters  # noqa: F401


@pytest.fixture(scope="module")
def kernels():
    module = interpreted_module("miles_host.kernels.mla_attention")
    _scalar_loop_bounds()
    return module


def _check(kernels, lengths_new, lengths_ctx, heads, splits, rank=32, rope=16, page=16, is_decode=None):
    q_latent, q_rope, cache, meta, scale, reference = latent_case(lengths_new, lengths_ctx, heads, rank, rope,
                                                                  page=page, is_decode=is_decode)
    out = kernels.mla_attention_triton(q_latent, q_rope, cache, meta, scale=scale, splits=splits)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    return meta


# 16 heads: one head block of one token; 24: two blocks, the second part-empty; 4: several tokens per tile
@pytest.mark.parametrize("heads", [16, 24, 4])
@pytest.mark.parametrize("splits", [1, 2, 16])
def test_decode_matches_the_reference(kernels, counters, heads, splits):  # noqa: F811
    meta = _check(kernels, [1, 1, 1], [5, 130, 77], heads, splits)
    head_blocks = -(-heads // kernels.heads_per_program(heads, kernels.tokens_per_tile(heads, 1, True)))
    pairs = meta.tile_seq.shape[0] * head_blocks
    assert counters.requested == ([] if splits == 1 else [pairs])
    assert not counters.any(), "the last program of every (tile, head block) resets its counter"


@pytest.mark.parametrize("heads", [16, 4])
def test_prefill_and_multi_token_steps(kernels, counters, heads):  # noqa: F811
    """Prefill chunks over a cached prefix (tiles of several tokens for few heads); a verify-like
    decode step of several tokens per sequence, split; a rank and rope width off powers of two."""
    _check(kernels, [5, 2, 40], [5, 70, 40], heads, 1)
    _check(kernels, [3, 1], [90, 9], heads, 4, rank=24, rope=8, page=8, is_decode=True)
    assert not counters.any()


def test_rows_per_program_stay_within_the_budget(kernels):
    for heads in (1, 4, 16, 128):
        for tokens in (1, 4, 16):
            assert kernels.heads_per_program(heads, tokens) * tokens <= max(kernels.LATENT_ROWS, tokens)
    assert kernels.heads_per_program(128, 1) == 16  # DeepSeek-V3's decode: 8 head blocks per token
