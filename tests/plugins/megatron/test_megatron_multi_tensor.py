"""Megatron-Core's gradient norm and clipping on :mod:`miles_megatron.multi_tensor`'s
``_foreach`` ops (no Apex / TransformerEngine): the results of the float64 formulas, and
Megatron's optimizer modules use them. Skipped where megatron-core is not installed."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from miles_megatron.multi_tensor import foreach_l2_norm, foreach_scale  # noqa: E402


def _grads() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) * scale
            for shape, scale in (((3, 5), 1.0), ((7,), 1e-3), ((2, 4, 6), 30.0), ((1,), 0.5))]


def test_l2_norm_is_the_float64_norm():
    grads = _grads()
    total, per_tensor = foreach_l2_norm(2048, torch.zeros(1, dtype=torch.int), [grads], True)
    expected = torch.cat([g.double().flatten() for g in grads]).square().sum().sqrt()
    assert total.shape == (1,) and total.dtype == torch.float32
    torch.testing.assert_close(total.double(), expected.reshape(1), rtol=1e-6, atol=0)
    torch.testing.assert_close(per_tensor.double(), torch.stack([g.double().norm() for g in grads]), rtol=1e-6, atol=0)
    assert foreach_l2_norm(2048, None, [grads], False)[1] is None


def test_scale_in_place_and_into_other_tensors():
    grads = _grads()
    expected = [g.double() * 0.25 for g in grads]
    foreach_scale(2048, None, [grads, grads], 0.25)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=0)
    sources = _grads()
    targets = [torch.empty_like(s, dtype=torch.bfloat16) for s in sources]
    foreach_scale(2048, None, [sources, targets], 1.0)  # Megatron's copy between main and model params
    assert all(torch.equal(t, s.bfloat16()) for s, t in zip(sources, targets))
    foreach_scale(2048, None, [sources, targets], 3.0)
    assert all(torch.equal(t, (s * 3.0).bfloat16()) for s, t in zip(sources, targets))


@pytest.mark.skipif(importlib.util.find_spec("apex") is not None
                    or importlib.util.find_spec("transformer_engine") is not None,
                    reason="Megatron uses Apex's / TransformerEngine's kernels where they import")
def test_megatron_clips_with_these_ops():
    from megatron.core.optimizer import clip_grads, optimizer

    from miles_megatron.megatron_optimizer import _on
    from miles_megatron.runtime import init_model_parallel, leave_model_parallel

    init_model_parallel(torch.device("cpu"))  # (installs the ops; a one-rank group)
    assert clip_grads.l2_norm_impl is foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is foreach_scale and optimizer.multi_tensor_scale_impl is foreach_scale
    params = [torch.nn.Parameter(g.clone()) for g in _grads()]
    for param in params:
        param.grad = param.detach() * 2.0
    expected = torch.cat([p.grad.double().flatten() for p in params]).norm().item()
    try:
        with _on(torch.device("cpu")):
            norm = clip_grads.get_grad_norm_fp32([p.grad for p in params],
                                                 grad_stats_parallel_group=torch.distributed.group.WORLD)
            clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=norm)
    finally:
        leave_model_parallel()
    assert norm == pytest.approx(expected, rel=1e-6)
    clipped = torch.cat([p.grad.double().flatten() for p in params]).norm().item()
    assert clipped == pytest.approx(1.0, rel=1e-5)
