"""Megatron-Core's multi-tensor gradient ops on ``torch._foreach_*`` where Apex and
TransformerEngine are absent.

Megatron's optimizers norm, clip and copy gradients through ``multi_tensor_applier`` with
Apex's / TransformerEngine's fused kernels (``multi_tensor_l2norm``, ``multi_tensor_scale``).
Without either, Megatron-Core 0.16 falls back to ``megatron.core.utils``'s
``local_multi_tensor_l2_norm`` and ``local_multi_tensor_scale``: the norm builds a host
tensor out of each gradient's norm, one device-to-host sync per parameter tensor (the MoE
bench shape has ~1,100: each expert's two linears are their own parameters), and the scale
launches a multiply and a copy per tensor. This backend runs without both libraries
(local layer spec, torch optimizer), so :func:`use_foreach_ops` puts these drop-ins in
Megatron's optimizer modules instead: the same signatures and results (float32 norms of
float32 gradients), one ``_foreach`` launch per list and no sync. Where Apex or
TransformerEngine imports, Megatron's own kernels stay.
"""

from __future__ import annotations

from typing import Any

import torch


def foreach_l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
                    per_tensor: bool, *args: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``amp_C.multi_tensor_l2norm``: the 2-norm of all tensors of ``tensor_lists[0]`` as a
    one-element float32 tensor on their device (and each tensor's norm if ``per_tensor``)."""
    tensors = tensor_lists[0]
    norms = torch.stack([norm.float() for norm in torch._foreach_norm(tensors)])
    return torch.linalg.vector_norm(norms).reshape(1), (norms if per_tensor else None)


def foreach_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
                  scale: float) -> None:
    """``amp_C.multi_tensor_scale``: ``tensor_lists[1][i] = tensor_lists[0][i] * scale``
    (in place when the lists are the same tensors)."""
    sources, targets = tensor_lists
    if all(source is target for source, target in zip(sources, targets)):
        torch._foreach_mul_(targets, scale)
    elif scale == 1.0:
        torch._foreach_copy_(targets, sources)
    else:
        torch._foreach_copy_(targets, torch._foreach_mul(sources, scale))


def use_foreach_ops() -> None:
    """These ops in Megatron's optimizer modules wherever they hold Megatron's local
    fallbacks (see module doc)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale
