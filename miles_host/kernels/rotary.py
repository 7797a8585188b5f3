"""Per-head q/k RMSNorm plus rotary embedding, for queries and keys in one kernel.

``qk_norm_rope(q_TC, k_TC, ...)`` takes queries ``[T, Nq * D]`` and keys
``[T, Nk * D]`` (row-strided views of the fused qkv projection are fine) and
returns contiguous ``q_TND, k_TND``: each head optionally RMS-normed with its
weight (Qwen3's ``q_norm`` / ``k_norm``), then rotated like
:func:`~miles_host.kernels.eager_ops.apply_rotary` (interleaved pairs come out
de-interleaved; dims past the rotary dims pass through). Replaces about thirty
eager kernels per layer by one. Reference: :func:`qk_norm_rope_reference`.

:func:`qk_norm_rope_into_cache` is the engine's decode form: the same kernel also stores
each token's rotated keys and its values in the paged KV cache at the token's slot (what
:func:`~miles_host.kernels.paged_attention.write_kv_cache` would do in a launch of its own).
"""

from __future__ import annotations

from miles_host.kernels.eager_ops import apply_rotary, rms_norm_eager


def qk_norm_rope_reference(
    q_TC, k_TC, num_q_heads, num_kv_heads, head_dim, cos_TR, sin_TR, *,
    q_weight=None, k_weight=None, eps=1e-6, unit_offset=False, interleaved=False,
):
    """Plain PyTorch: the eager per-head norm (when weights are given), then the eager rotary."""
    num_tokens = q_TC.shape[0]
    q_TND = q_TC.reshape(num_tokens, num_q_heads, head_dim)
    k_TND = k_TC.reshape(num_tokens, num_kv_heads, head_dim)
    if q_weight is not None:
        q_TND = rms_norm_eager(q_TND, q_weight, eps, unit_offset)
        k_TND = rms_norm_eager(k_TND, k_weight, eps, unit_offset)
    return apply_rotary(q_TND, cos_TR, sin_TR, interleaved), apply_rotary(k_TND, cos_TR, sin_TR, interleaved)


def qk_norm_rope(
    q_TC, k_TC, num_q_heads, num_kv_heads, head_dim, cos_TR, sin_TR, *,
    q_weight=None, k_weight=None, eps=1e-6, unit_offset=False, interleaved=False,
):
    """Fused on CUDA (weights, tables and activations of one dtype); the reference otherwise.
    Differentiable (the reference's gradient, :mod:`~miles_host.kernels.eager_backward`)."""
    dtypes_match = all(t is None or t.dtype == q_TC.dtype for t in (k_TC, cos_TR, sin_TR, q_weight, k_weight))
    if not q_TC.is_cuda or not dtypes_match or q_TC.stride(-1) != 1 or k_TC.stride(-1) != 1:
        return qk_norm_rope_reference(
            q_TC, k_TC, num_q_heads, num_kv_heads, head_dim, cos_TR, sin_TR,
            q_weight=q_weight, k_weight=k_weight, eps=eps, unit_offset=unit_offset, interleaved=interleaved,
        )
    from miles_host.kernels.eager_backward import fused_with_eager_backward

    return fused_with_eager_backward(
        _fused, _reference, q_TC, k_TC, cos_TR.contiguous(), sin_TR.contiguous(), q_weight, k_weight,
        heads=(num_q_heads, num_kv_heads, head_dim), eps=eps, unit_offset=unit_offset, interleaved=interleaved,
    )


def qk_norm_rope_into_cache(
    q_TC, k_TC, v_TC, num_q_heads, num_kv_heads, head_dim, cos_TR, sin_TR, k_cache_XHD, v_cache_XHD, slots_T, *,
    q_weight=None, k_weight=None, eps=1e-6, unit_offset=False, interleaved=False,
):
    """:func:`qk_norm_rope` of the queries (returned ``[T, Nq, D]``) with the rotated keys and the
    values ``v_TC [T, Nk * D]`` stored in the caches (flattened over their slots, ``[X, Nk, D]``)
    at ``slots_T``, all in one launch; inference only. Where the kernel does not apply (CPU,
    mixed dtypes, a cache of another dtype) the reference and two ``index_copy_``: the same values."""
    tensors = (k_TC, v_TC, cos_TR, sin_TR, q_weight, k_weight, k_cache_XHD, v_cache_XHD)
    fusable = (q_TC.is_cuda and all(t is None or t.dtype == q_TC.dtype for t in tensors)
               and all(t.stride(-1) == 1 for t in (q_TC, k_TC, v_TC)))
    if fusable:
        from miles_host.kernels import _rotary_triton

        q_TND, _ = _rotary_triton.qk_norm_rope(
            q_TC, k_TC, num_q_heads, num_kv_heads, head_dim, cos_TR.contiguous(), sin_TR.contiguous(), q_weight,
            k_weight, eps, unit_offset, interleaved, kv_store=(v_TC, k_cache_XHD, v_cache_XHD, slots_T),
        )
        return q_TND
    q_TND, k_TND = qk_norm_rope_reference(
        q_TC, k_TC, num_q_heads, num_kv_heads, head_dim, cos_TR, sin_TR,
        q_weight=q_weight, k_weight=k_weight, eps=eps, unit_offset=unit_offset, interleaved=interleaved,
    )
    k_cache_XHD.index_copy_(0, slots_T, k_TND.to(k_cache_XHD.dtype))
    v_cache_XHD.index_copy_(0, slots_T, v_TC.reshape(k_TND.shape).to(v_cache_XHD.dtype))
    return q_TND


def _fused(q_TC, k_TC, cos_TR, sin_TR, q_weight, k_weight, *, heads, eps, unit_offset, interleaved):
    from miles_host.kernels import _rotary_triton

    return _rotary_triton.qk_norm_rope(
        q_TC, k_TC, *heads, cos_TR, sin_TR, q_weight, k_weight, eps, unit_offset, interleaved
    )


def _reference(q_TC, k_TC, cos_TR, sin_TR, q_weight, k_weight, *, heads, eps, unit_offset, interleaved):
    return qk_norm_rope_reference(
        q_TC, k_TC, *heads, cos_TR, sin_TR,
        q_weight=q_weight, k_weight=k_weight, eps=eps, unit_offset=unit_offset, interleaved=interleaved,
    )
