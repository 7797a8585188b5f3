"""Route ``aten::mm``, ``aten::addmm`` and ``aten::mean.dim`` to the batch-invariant kernels.

``with batch_invariant_aten():`` registers Python kernels for the three ops at the
CUDA dispatch key (``torch.library.Library("aten", "IMPL")``), so every
``F.linear``, ``x @ w``, ``nn.Linear`` and ``x.mean(-1)`` of CUDA tensors runs
:func:`~.invariant_matmul.invariant_mm` / :func:`~.invariant_reduce.invariant_row_mean`
while inside; on exit the library is destroyed and the stock kernels (cuBLAS,
PyTorch's reductions) are back. The registration sits below autograd: backward
formulas call ``mm`` too, and run whatever is registered when backward runs
(inside the context: the invariant kernels).

What is invariant and what is not:

- ``mm`` / ``addmm`` of bf16/fp16/fp32 2-D operands: the invariant GEMM.
  ``addmm(bias, a, b)`` with ``beta = alpha = 1`` and a 1-D (or ``[1, N]``) bias
  is ``F.linear``: bias added in the kernel's epilogue. Other ``beta``/``alpha``
  or a 2-D ``self``: the GEMM in fp32, then ``alpha * ab + beta * self`` in fp32
  and one rounding (elementwise: still per-row invariant). Other dtypes (float64,
  complex): a batch-of-one ``bmm`` / ``baddbmm``, cuBLAS, *not* invariant.
- ``mean.dim`` over the last dim of bf16/fp16/fp32: the invariant row mean. Any
  other dim list (or dtype): ``torch.sum(x, dim, keepdim, dtype=fp32 or wider) /
  n``, which does not call ``aten::mean``, *not* batch-invariant.
- Not routed: ``bmm`` / ``baddbmm`` (batched ``matmul``), the ``out=`` and in-place
  variants (``mm.out``, ``addmm_``), ``mean`` without ``dim``.

The registration is process-wide (every thread) and re-entrant: a nested
``batch_invariant_aten()`` is a no-op and the outermost exit restores the stock
kernels, exceptions included. :func:`is_active` tells other code (e.g. the MoE
combine) that the mode is on. Entering + exiting (create the library, three
``impl`` calls, ``_destroy``) costs about 20 us on a CPU (measured with a
CPU-key registration, torch 2.13): cheap enough per forward, not per op.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence

import torch

from miles_host.kernels.invariant_matmul import DTYPES, invariant_mm
from miles_host.kernels.invariant_reduce import invariant_row_mean

_LOCK = threading.Lock()
_LIBRARY: torch.library.Library | None = None
_ACTIVE = False
#: calls of each override since import (tests check that a registration is live or gone)
CALLS: Counter[str] = Counter()


def is_active() -> bool:
    """Whether :func:`batch_invariant_aten` is in force (anywhere in the process)."""
    return _ACTIVE


# ----------------------------------------------------------------------------- the overrides


def _invariant_operands(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]
        and a.dtype == b.dtype and a.dtype in DTYPES and a.device == b.device
    )


def mm(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """``aten::mm``: the invariant GEMM; unsupported operands go to a batch-of-one ``bmm``
    (which also raises PyTorch's own errors for bad shapes or dtypes)."""
    CALLS["mm"] += 1
    if _invariant_operands(a_MK, b_KN):
        return invariant_mm(a_MK, b_KN)
    return torch.bmm(a_MK.unsqueeze(0), b_KN.unsqueeze(0)).squeeze(0)


def addmm(self: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    """``aten::addmm``: ``beta * self + alpha * mat1 @ mat2`` (``self`` broadcast to ``[M, N]``)."""
    CALLS["addmm"] += 1
    if not _invariant_operands(mat1, mat2):
        return torch.baddbmm(self.unsqueeze(0), mat1.unsqueeze(0), mat2.unsqueeze(0), beta=beta, alpha=alpha).squeeze(0)
    n = mat2.shape[1]
    if beta == 1 and alpha == 1 and self.dim() <= 2 and self.numel() == n and self.shape[-1:] == (n,):
        return invariant_mm(mat1, mat2, self.reshape(n))  # F.linear: the bias in the epilogue
    out_MN = invariant_mm(mat1, mat2, out_dtype=torch.float32)
    if alpha != 1:
        out_MN = out_MN * alpha
    if beta != 0:  # beta = 0 ignores self, NaN included (as torch)
        out_MN = out_MN + beta * self.to(torch.float32)
    return out_MN.to(mat1.dtype)


def _reduced_count(x: torch.Tensor, dim: int | Sequence[int] | None) -> int:
    if dim is None or (isinstance(dim, Sequence) and len(dim) == 0) or x.dim() == 0:
        return x.numel()
    dims = {d % x.dim() for d in ([dim] if isinstance(dim, int) else dim)}
    count = 1
    for d in dims:
        count *= x.shape[d]
    return count


def mean_by_sum(x: torch.Tensor, dim=None, keepdim: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.mean(x, dim, keepdim, dtype=dtype)`` as a sum (fp32 or wider) over the count.

    The fallback of :func:`mean_dim` for what :func:`invariant_row_mean` does not
    take: it never calls ``aten::mean``, and it is NOT batch-invariant (``torch.sum``
    chooses its split from the shape).
    """
    out_dtype = dtype or x.dtype
    if not (out_dtype.is_floating_point or out_dtype.is_complex):
        raise RuntimeError(f"mean(): could not infer output dtype. Input dtype must be either a floating point or "
                           f"complex dtype. Got: {out_dtype}")
    sum_dtype = torch.float32 if out_dtype in (torch.bfloat16, torch.float16) else out_dtype
    total = torch.sum(x, dim, keepdim, dtype=sum_dtype)
    return (total / _reduced_count(x, dim)).to(out_dtype)


def mean_dim(self: torch.Tensor, dim, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``aten::mean.dim``: the invariant row mean over the last dim, else :func:`mean_by_sum`."""
    CALLS["mean.dim"] += 1
    try:
        return invariant_row_mean(self, dim, keepdim, dtype)
    except NotImplementedError:
        return mean_by_sum(self, dim, keepdim, dtype)


#: (aten op, override) pairs registered by :func:`batch_invariant_aten`
OVERRIDES = (("mm", mm), ("addmm", addmm), ("mean.dim", mean_dim))


# ----------------------------------------------------------------------------- the switch


def _register(dispatch_key: str) -> bool:
    """Register the overrides unless already registered; True when this call did."""
    global _LIBRARY, _ACTIVE
    with _LOCK:
        if _LIBRARY is not None:
            return False
        library = torch.library.Library("aten", "IMPL")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "overriding a previously registered kernel": the point
                for name, fn in OVERRIDES:
                    library.impl(name, fn, dispatch_key)
        except BaseException:
            library._destroy()
            raise
        _LIBRARY, _ACTIVE = library, True
        return True


def _unregister() -> None:
    global _LIBRARY, _ACTIVE
    with _LOCK:
        library, _LIBRARY, _ACTIVE = _LIBRARY, None, False
        if library is not None:
            library._destroy()


@contextlib.contextmanager
def batch_invariant_aten(dispatch_key: str = "CUDA") -> Iterator[None]:
    """While inside, ``aten::mm`` / ``addmm`` / ``mean.dim`` at ``dispatch_key`` run the invariant kernels.

    ``dispatch_key``: ``"CUDA"`` (the mode); ``"CPU"`` only for tests of the switch
    itself (CPU tensors then take the float64 references, or the kernels under
    ``TRITON_INTERPRET=1``). Nested use is a no-op (the outer key stays).
    """
    registered = _register(dispatch_key)
    try:
        yield
    finally:
        if registered:
            _unregister()
