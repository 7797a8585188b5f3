"""Per-head q/k RMSNorm plus rotary embedding, for queries and keys in one kernel.

``qk_norm_rope(q_TC, k_TC, ...)`` takes queries ``[T, Nq * D]`` and keys
``[T, Nk * D]`` (row-strided views of the fused qkv projection are fine) and
returns contiguous ``q_TND, k_TND``: each head optionally RMS-normed with its
weight (Qwen3's ``q_norm`` / ``k_norm``), then rotated like
:func:`~miles_host.kernels.eager_ops.apply_rotary` (interleaved pairs come out
de-interleaved; dims past the rotary dims pass through). Replaces about thirty
eager kernels per layer by one. Reference: :func:`qk_norm_rope_reference`.
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
