"""Batch-invariant row reductions for ``--true-on-policy``: the mean of a row, token log-probs.

PyTorch's reductions split a row over threads and blocks by the whole tensor's
shape, so one row's sum can change with the number of rows. These kernels give
each row one Triton program that walks the row in fixed chunks from column 0,
with fp32 accumulation: the order depends on the row length only.

- :func:`invariant_row_mean`: ``torch.mean`` over the last dimension (RMSNorm's
  ``x.pow(2).mean(-1, keepdim=True)``); other dims raise ``NotImplementedError``
  (the caller falls back, see :mod:`.invariant_ops`).
- :func:`invariant_log_probs`: ``log_softmax(softcap(logits) / temperature)`` at the
  target, and the entropy, one pass over the vocabulary with an online logsumexp.

References in float64: :func:`invariant_row_mean_reference`, :func:`invariant_log_probs_reference`.
No autograd: these are forward values (the trainer's backward keeps the fast formulas).
Tensor legend: R rows, L row length, T tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from miles_host.kernels.invariant_matmul import DTYPES, uses_triton


def _last_dim(x: torch.Tensor, dim: int | Sequence[int] | None) -> bool:
    """Whether ``dim`` names exactly the last dimension of ``x``."""
    if isinstance(dim, Sequence):
        if len(dim) != 1:
            return False
        dim = dim[0]
    if dim is None or x.dim() == 0:
        return False
    return int(dim) % x.dim() == x.dim() - 1


def invariant_row_mean_reference(
    x: torch.Tensor, dim: int | Sequence[int] = -1, keepdim: bool = False, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Plain PyTorch: the mean over the last dim in float64, rounded once (a sum: ``aten::mean`` may be routed here)."""
    if not _last_dim(x, dim):
        raise NotImplementedError(f"invariant_row_mean reduces the last dim only; got dim={dim} of a {x.dim()}-d tensor")
    return (x.double().sum(-1, keepdim=keepdim) / x.shape[-1]).to(dtype or x.dtype)


def invariant_row_mean(
    x: torch.Tensor, dim: int | Sequence[int] = -1, keepdim: bool = False, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``torch.mean(x, dim, keepdim, dtype=dtype)`` for ``dim`` the last dimension, one program per row.

    ``x``: bf16/fp16/fp32, any shape ``[..., L]`` (a non-contiguous ``x`` is copied
    first: copies are exact). Output: ``dtype`` if given (bf16/fp16/fp32), else
    ``x.dtype``; fp32 sum, one division by ``L``, one rounding. ``L = 0`` gives NaN
    (as torch). ``NotImplementedError`` for any other ``dim`` or dtype.
    On CUDA (and CPU under ``TRITON_INTERPRET=1``) the kernel; elsewhere the reference.
    """
    if not _last_dim(x, dim):
        raise NotImplementedError(f"invariant_row_mean reduces the last dim only; got dim={dim} of a {x.dim()}-d tensor")
    out_dtype = dtype or x.dtype
    if x.dtype not in DTYPES or out_dtype not in DTYPES:
        raise NotImplementedError(f"invariant_row_mean runs bf16/fp16/fp32; got {x.dtype} -> {out_dtype}")
    if not uses_triton(x):
        return invariant_row_mean_reference(x, dim, keepdim, dtype)
    length = x.shape[-1]
    out_shape = x.shape[:-1] + ((1,) if keepdim else ())
    if length == 0:
        return torch.full(out_shape, float("nan"), dtype=out_dtype, device=x.device)
    from miles_host.kernels import _invariant_reduce_triton

    x_RL = x.reshape(-1, length)
    if x_RL.stride(-1) != 1:
        x_RL = x_RL.contiguous()
    return _invariant_reduce_triton.row_mean(x_RL, out_dtype).reshape(out_shape)


def _scaled_logits64(logits_TV: torch.Tensor, temperature: float, logit_softcap: float | None) -> torch.Tensor:
    x = logits_TV.float().double()
    if logit_softcap is not None:
        x = torch.tanh(x / logit_softcap) * logit_softcap
    return x / temperature


def invariant_log_probs_reference(
    logits_TV: torch.Tensor,
    targets_T: torch.Tensor,
    *,
    temperature: float = 1.0,
    logit_softcap: float | None = None,
    return_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain PyTorch in float64 (rounded to fp32 at the end): the formula of :func:`invariant_log_probs`."""
    log_p_TV = torch.log_softmax(_scaled_logits64(logits_TV, temperature, logit_softcap), dim=-1)
    log_probs_T = log_p_TV.gather(-1, targets_T.long().unsqueeze(-1)).squeeze(-1).float()
    if not return_entropy:
        return log_probs_T, None
    p_TV = log_p_TV.exp()
    entropy_T = -torch.where(p_TV > 0, p_TV * log_p_TV, 0.0).sum(-1)
    return log_probs_T, entropy_T.float()


def invariant_log_probs(
    logits_TV: torch.Tensor,
    targets_T: torch.Tensor,
    *,
    temperature: float = 1.0,
    logit_softcap: float | None = None,
    return_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row: ``x = fp32(logits)``, ``x = tanh(x / softcap) * softcap`` (if given), ``x = x / temperature``;
    ``log_probs[t] = x[t, target_t] - logsumexp(x[t])`` and ``entropy[t] = -sum softmax(x) log_softmax(x)``.

    ``logits_TV``: bf16/fp16/fp32, any strides. ``targets_T``: integer ``[T]``; a
    target outside ``[0, V)`` gives NaN (no host sync to check). Returns fp32
    ``([T], [T] or None)``. One program per row, one pass over V in chunks of
    :data:`~._invariant_reduce_triton.MAX_BLOCK` (online max / sum / entropy
    moments, ``-inf`` logits allowed), so a row never depends on the others.
    On CUDA (and CPU under ``TRITON_INTERPRET=1``) the kernel; elsewhere the reference.
    """
    if logits_TV.dim() != 2 or targets_T.shape != logits_TV.shape[:1] or logits_TV.shape[1] == 0:
        raise ValueError(f"invariant_log_probs takes logits [T, V > 0] and targets [T]; "
                         f"got {tuple(logits_TV.shape)} and {tuple(targets_T.shape)}")
    if logits_TV.dtype not in DTYPES or targets_T.is_floating_point():
        raise ValueError(f"invariant_log_probs takes bf16/fp16/fp32 logits and integer targets; "
                         f"got {logits_TV.dtype}, {targets_T.dtype}")
    if not uses_triton(logits_TV):
        return invariant_log_probs_reference(logits_TV, targets_T, temperature=temperature,
                                             logit_softcap=logit_softcap, return_entropy=return_entropy)
    from miles_host.kernels import _invariant_reduce_triton

    return _invariant_reduce_triton.log_probs(logits_TV, targets_T, temperature, logit_softcap, return_entropy)
