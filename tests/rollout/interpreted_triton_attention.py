"""CPU tests of :mod:`miles_host.kernels.paged_attention` under Triton's interpreter (not collected by itself).

Run by ``test_triton_attention.py::test_cpu_kernels_under_the_triton_interpreter`` in a
fresh process with ``TRITON_INTERPRET=1``; alone:
``TRITON_INTERPRET=1 python -m pytest tests/rollout/interpreted_triton_attention.py``.
Float32 operands (the interpreter's ``dot`` reads bfloat16 as raw integers), so the
kernels are held to float32 round-off against the reference.
"""

from __future__ import annotations

import pytest
import torch

from miles_host.kernels import split_k
from miles_host.rollout.attention import AttentionMetadata, merge_attention_states, paged_attention_reference
from tests.plugins.triton_interpret import interpreted_module
from tests.rollout.test_attention import paged_case

HEADS_Q, HEADS_KV, DIM = 8, 2, 32  # GQA group 4
PAGE = 16


@pytest.fixture(scope="module")
def kernels():
    module = interpreted_module("miles_host.kernels.paged_attention")
    _scalar_loop_bounds()
    return module


def _scalar_loop_bounds() -> None:
    """Let loaded scalars bound a ``range`` in the interpreter (the attention loops run to the context).

    The interpreter holds a loaded scalar as a one-element array and its ``__index__`` calls
    ``int()`` on it, which NumPy >= 2.3 refuses for arrays of one dimension."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "scalar_loop_bounds", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched.scalar_loop_bounds = True
    interpreter._patch_lang_tensor = patched


@pytest.fixture
def counters(monkeypatch):
    """The split counters the kernel gets, with the counts it asked for."""
    buffer = torch.zeros(64, dtype=torch.int32)
    buffer.requested = []

    def semaphores(device, count):
        buffer.requested.append(count)
        return buffer

    monkeypatch.setattr(split_k, "semaphores", semaphores)
    return buffer


def _case(kernels, lengths_new, lengths_ctx, *, is_decode=True, invariant=False, dim_v=DIM, seed=0):
    q, k_cache, v_cache, tables, cu = paged_case(lengths_new, lengths_ctx, HEADS_Q, HEADS_KV, DIM, dim_v,
                                                 block_size=PAGE, seed=seed)
    meta = AttentionMetadata(
        slot_mapping_T=torch.zeros(cu[-1], dtype=torch.long),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        context_lens_B=torch.tensor(lengths_ctx, dtype=torch.int32),
        block_tables_BM=tables, max_q_len=max(lengths_new), max_context_len=max(lengths_ctx),
        is_decode=is_decode,
    )
    per_tile = kernels.tokens_per_tile(HEADS_Q, HEADS_KV, is_decode, invariant)
    meta.tile_seq, meta.tile_q_start = kernels.build_tiles(cu, per_tile, "cpu")
    return q, k_cache, v_cache, tables, cu, meta


def _check(kernels, lengths_new, lengths_ctx, window, softcap, splits, **kwargs):
    q, k_cache, v_cache, tables, cu, meta = _case(kernels, lengths_new, lengths_ctx, **kwargs)
    out = kernels.paged_attention_triton(q, k_cache, v_cache, meta, scale=DIM ** -0.5, sliding_window=window,
                                         logit_softcap=softcap, splits=splits)
    ref = paged_attention_reference(q, k_cache, v_cache, tables, cu, lengths_ctx, scale=DIM ** -0.5,
                                    sliding_window=window, logit_softcap=softcap)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    return meta


# one context shorter than a key block (most splits empty), ones off the page size, one of
# several key blocks per split at 2 splits
@pytest.mark.parametrize("lengths_ctx", [[5], [5, 130, 77]])
@pytest.mark.parametrize("window, softcap", [(None, None), (40, None), (None, 5.0)])
@pytest.mark.parametrize("splits", [1, 2, 16])
def test_split_decode_matches_the_reference(kernels, counters, lengths_ctx, window, softcap, splits):
    meta = _check(kernels, [1] * len(lengths_ctx), lengths_ctx, window, softcap, splits)
    pairs = meta.tile_seq.shape[0] * HEADS_KV
    assert counters.requested == ([] if splits == 1 else [pairs])
    assert not counters.any(), "the last program of every tile resets its counter"


@pytest.mark.parametrize("splits", [3, 16])
def test_split_decode_of_several_tokens_per_sequence(kernels, counters, splits):
    """Multi-token decode tiles (speculative verification), V narrower than K, a window."""
    _check(kernels, [3, 1, 4], [200, 9, 70], 50, None, splits, dim_v=16)
    assert counters.requested and not counters.any()


def test_default_splits_fill_an_h200(kernels, counters):
    meta = _check(kernels, [1], [300], None, None, None)
    assert kernels.decode_splits(meta.tile_seq.shape[0], HEADS_KV, torch.device("cpu")) == 16
    assert counters.requested == [HEADS_KV] and not counters.any()


class _NoLaunch:
    """Wraps the attention kernel: launches it, but fails when a launch asks for more than one split."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        if grid[2] > 1:
            raise AssertionError("the split-KV kernel was launched")
        return self.kernel[grid]


@pytest.mark.parametrize("lengths_new, lengths_ctx, is_decode", [([1, 1], [5, 130], True), ([3, 2], [40, 70], False)])
def test_invariant_mode_and_prefill_never_split(kernels, counters, monkeypatch, lengths_new, lengths_ctx, is_decode):
    monkeypatch.setattr(kernels, "_paged_attention_kernel", _NoLaunch(kernels._paged_attention_kernel))
    q, k_cache, v_cache, tables, cu, meta = _case(kernels, lengths_new, lengths_ctx, is_decode=is_decode,
                                                  invariant=True)
    ref = paged_attention_reference(q, k_cache, v_cache, tables, cu, lengths_ctx, scale=0.2)
    out = kernels.paged_attention_triton(q, k_cache, v_cache, meta, scale=0.2, invariant=True, splits=16)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if not is_decode:
        meta = _case(kernels, lengths_new, lengths_ctx, is_decode=False)[-1]
        out = kernels.paged_attention_triton(q, k_cache, v_cache, meta, scale=0.2, splits=16)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert counters.requested == []
    if is_decode:  # the same decode step, not invariant: split
        with pytest.raises(AssertionError, match="split-KV kernel was launched"):
            kernels.paged_attention_triton(q, k_cache, v_cache, meta, scale=0.2)


# ----------------------------------------------------------------------------- KV write


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _kv_operands(num_tokens, heads, dim, dim_v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # a fused qkv row, sliced: k and v are strided views
    qkv = torch.randn(num_tokens, heads * (2 * dim + dim_v), generator=g) * 3
    qkv[0, :4] = torch.tensor([0.0, -0.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8])  # signed zeros, bf16 ties
    qkv = qkv.to(dtype)
    k = qkv[:, heads * dim:2 * heads * dim].view(num_tokens, heads, dim)
    v = qkv[:, 2 * heads * dim:].view(num_tokens, heads, dim_v)
    k[0, 0, :4] = qkv[0, :4]
    return k, v


@pytest.mark.parametrize("src, cache", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                        (torch.bfloat16, torch.bfloat16), (torch.float16, torch.bfloat16),
                                        (torch.bfloat16, torch.float32), (torch.float32, torch.float16)])
@pytest.mark.parametrize("heads, dim, dim_v, elements", [(2, 32, 32, 4096), (3, 32, 16, 4096), (5, 16, 32, 32)])
def test_kv_write_is_index_copy_bit_for_bit(kernels, monkeypatch, src, cache, heads, dim, dim_v, elements):
    """Strided k/v, V narrower or wider than K, heads not a power of two, several head blocks."""
    monkeypatch.setattr(kernels, "KV_WRITE_ELEMENTS", elements)
    num_blocks, num_tokens = 6, 9
    k, v = _kv_operands(num_tokens, heads, dim, dim_v, src)
    slots = torch.randperm(num_blocks * PAGE, generator=torch.Generator().manual_seed(1))[:num_tokens]
    k_cache = torch.randn(num_blocks, PAGE, heads, dim).to(cache)
    v_cache = torch.randn(num_blocks, PAGE, heads, dim_v).to(cache)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    k_expected.view(-1, heads, dim).index_copy_(0, slots, k.to(cache))
    v_expected.view(-1, heads, dim_v).index_copy_(0, slots, v.to(cache))
    kernels.write_kv_cache(k_cache, v_cache, k, v, slots)
    assert torch.equal(_bits(k_cache), _bits(k_expected))
    assert torch.equal(_bits(v_cache), _bits(v_expected))


def _prefill_metadata(kernels, cu: list[int], lengths_ctx: list[int], tables, heads: int) -> AttentionMetadata:
    """A prefill step's metadata for multi-head attention (as many KV heads as query heads), with its tiles."""
    lengths_new = [b - a for a, b in zip(cu, cu[1:])]
    meta = AttentionMetadata(
        slot_mapping_T=torch.zeros(cu[-1], dtype=torch.long), cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        context_lens_B=torch.tensor(lengths_ctx, dtype=torch.int32), block_tables_BM=tables,
        max_q_len=max(lengths_new), max_context_len=max(lengths_ctx), is_decode=False,
    )
    meta.tile_seq, meta.tile_q_start = kernels.build_tiles(cu, kernels.tokens_per_tile(heads, heads, False), "cpu")
    return meta


def test_multi_head_prefill_over_a_cached_prefix_at_the_expanded_mla_widths(kernels):
    """``--mla-prefill expanded``'s launch: one KV head per query head, a key width off a power of two
    (DeepSeek-V3: 192, padded to 256) and a narrower value (128), new tokens after a cached prefix."""
    heads, dim, dim_v, lengths_new, lengths_ctx = 4, 24, 16, [5, 3], [21, 3]
    q, k_cache, v_cache, tables, cu = paged_case(lengths_new, lengths_ctx, heads, heads, dim, dim_v, block_size=PAGE)
    meta = _prefill_metadata(kernels, cu, lengths_ctx, tables, heads)
    out = kernels.paged_attention_triton(q, k_cache, v_cache, meta, scale=dim ** -0.5)
    ref = paged_attention_reference(q, k_cache, v_cache, tables, cu, lengths_ctx, scale=dim ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_prefill_over_key_parts_stores_each_rows_log_sum_exp(kernels):
    """The kernel over a key range with its rows' log-sum-exps against the reference's, ranges that start
    mid-page and mid-block, a range a query does not reach (zeros, -inf); merged, the whole context."""
    heads, dim, lengths_new, lengths_ctx = 4, 24, [7, 70], [90, 70]
    q, k_cache, v_cache, tables, cu = paged_case(lengths_new, lengths_ctx, heads, heads, dim, dim, block_size=PAGE)
    meta = _prefill_metadata(kernels, cu, lengths_ctx, tables, heads)
    parts = []
    for keys in ((0, 37), (37, 90)):
        out, lse = kernels.paged_attention_triton(q, k_cache, v_cache, meta, scale=dim ** -0.5, key_range=keys,
                                                  return_lse=True)
        ref, ref_lse = paged_attention_reference(q, k_cache, v_cache, tables, cu, lengths_ctx, scale=dim ** -0.5,
                                                 key_range=keys, return_lse=True)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
        parts.append((out, lse))
    assert parts[1][1][cu[1]].isneginf().all()  # sequence 1's first query (position 0) sees no key from 37
    whole = paged_attention_reference(q, k_cache, v_cache, tables, cu, lengths_ctx, scale=dim ** -0.5)
    torch.testing.assert_close(merge_attention_states(*zip(*parts)), whole, atol=1e-5, rtol=1e-5)
