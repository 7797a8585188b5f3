"""Fused forward, eager backward: the fused kernels inside an autograd graph.

The fused kernels carry no autograd of their own. :func:`fused_with_eager_backward`
runs one in the forward and, in backward, recomputes the op's plain-PyTorch
reference on the saved inputs and differentiates that (the two compute the same
function up to rounding, so the gradient is the reference's). The batch-invariant
trainer (``--true-on-policy`` on CUDA) uses it to compute the forward values the
engine's fused kernels compute.
"""

from __future__ import annotations

from typing import Callable

import torch


def fused_with_eager_backward(fused: Callable, reference: Callable, *tensors, **settings):
    """``fused(*tensors, **settings)``; differentiable through ``reference`` (same signature)
    when grad mode is on and an input requires grad. ``tensors`` may contain None."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _FusedForwardEagerBackward.apply(fused, reference, settings, *tensors)
    return fused(*tensors, **settings)


class _FusedForwardEagerBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fused, reference, settings, *tensors):
        ctx.reference, ctx.settings = reference, settings
        ctx.save_for_backward(*tensors)
        return fused(*tensors, **settings)

    @staticmethod
    def backward(ctx, *grad_outputs):
        needs = ctx.needs_input_grad[3:]
        inputs = [
            None if t is None else t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, needs)
        ]
        with torch.enable_grad():
            outputs = ctx.reference(*inputs, **ctx.settings)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o is not None and g is not None and o.requires_grad]
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        grads = iter(
            torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
            if pairs and wanted else [None] * len(wanted)
        )
        return (None, None, None, *(next(grads) if t is not None and t.requires_grad else None for t in inputs))
