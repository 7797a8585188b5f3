"""CPU tests of the paged attention kernel's sinks and chunk masks under Triton's interpreter
(not collected by itself; run by ``tests/models/test_sinks_chunked_families.py`` in a fresh
process with ``TRITON_INTERPRET=1``). Float32 operands, held to float32 round-off against
:func:`~miles_host.rollout.attention.paged_attention_reference`."""

from __future__ import annotations

import pytest
import torch

from miles_host.rollout.attention import paged_attention_reference
from tests.rollout.interpreted_triton_attention import DIM, HEADS_Q, _case, counters, kernels  # noqa: F401


# prefill tiles that straddle chunk borders; decode unsplit and split over programs;
# sinks with a window (gpt-oss' sliding layers) and chunks with sinks
@pytest.mark.parametrize("lengths_new, lengths_ctx, is_decode, splits, invariant", [
    ([5, 9], [5, 70], False, 1, False), ([1, 1], [83, 7], True, 4, False), ([5, 9], [5, 70], False, 1, True),
])
@pytest.mark.parametrize("sinks, window, chunk", [(True, 20, None), (False, None, 16), (True, None, 24)])
def test_sinks_and_chunks_match_the_reference(kernels, counters, lengths_new, lengths_ctx, is_decode, splits,
                                              invariant, sinks, window, chunk):
    """Prefill, split decode and the invariant tile shape (``--true-on-policy`` on CUDA)."""
    q, k_cache, v_cache, tables, cu, meta = _case(kernels, lengths_new, lengths_ctx, is_decode=is_decode,
                                                  invariant=invariant)
    sink_logits = torch.linspace(-2.0, 3.0, HEADS_Q) if sinks else None
    kwargs = dict(scale=DIM ** -0.5, sliding_window=window, sinks=sink_logits, chunk_size=chunk)
    out = kernels.paged_attention_triton(q, k_cache, v_cache, meta, splits=splits, invariant=invariant, **kwargs)
    ref = paged_attention_reference(q, k_cache, v_cache, tables, cu, lengths_ctx, **kwargs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert not counters.any()
