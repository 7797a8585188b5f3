"""The fused-forward / eager-backward wrapper: forward values are the fused op's, gradients
the reference's, optional (None) inputs and outputs pass through."""

from __future__ import annotations

import torch

from miles_host.kernels.eager_backward import fused_with_eager_backward
from miles_host.kernels.rmsnorm import rmsnorm_reference


def _reference(x, w, r, *, eps, unit_offset):
    return rmsnorm_reference(x, w, eps, unit_offset, r)


def _fused(x, w, r, *, eps, unit_offset):
    """The same function computed differently (float64, then rounded): other bits."""
    y, s = rmsnorm_reference(x.double(), w.double(), eps, unit_offset, None if r is None else r.double())
    return y.to(x.dtype) + 1e-3, (None if s is None else s.to(x.dtype))


def test_forward_is_the_fused_op_and_gradients_are_the_references():
    torch.manual_seed(0)
    x = torch.randn(5, 16, requires_grad=True)
    w = torch.rand(16, requires_grad=True)
    r = torch.randn(5, 16, requires_grad=True)
    y, s = fused_with_eager_backward(_fused, _reference, x, w, r, eps=1e-6, unit_offset=False)
    expected_y, expected_s = _fused(x.detach(), w.detach(), r.detach(), eps=1e-6, unit_offset=False)
    assert torch.equal(y, expected_y) and torch.equal(s, expected_s)
    (y * torch.arange(16.0)).sum().backward(retain_graph=True)
    got = [t.grad.clone() for t in (x, w, r)]
    for t in (x, w, r):
        t.grad = None
    ref_y, _ = _reference(x, w, r, eps=1e-6, unit_offset=False)
    (ref_y * torch.arange(16.0)).sum().backward()
    for a, t in zip(got, (x, w, r)):
        torch.testing.assert_close(a, t.grad, rtol=0, atol=0)


def test_optional_input_and_output_and_no_grad_mode():
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.ones(8)  # no grad wanted for the weight
    y, s = fused_with_eager_backward(_fused, _reference, x, w, None, eps=1e-6, unit_offset=False)
    assert s is None and y.requires_grad
    y.sum().backward()
    assert x.grad is not None and w.grad is None
    with torch.no_grad():
        y2, _ = fused_with_eager_backward(_fused, _reference, x, w, None, eps=1e-6, unit_offset=False)
    assert not y2.requires_grad and torch.equal(y2, y.detach())
