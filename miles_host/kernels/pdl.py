"""Programmatic dependent launch (PDL) of the decode-path Triton kernels (Hopper and later).

A batch-1 decode step is a chain of ~120 small kernels (norms, GEMVs, rotary, attention,
the MoE route and experts), each a few microseconds long. Launched plainly, each kernel
starts only after the one before it has finished and its writes are flushed, so every
boundary costs a launch latency plus the ramp of the next kernel's weight stream. With PDL
(``cudaLaunchAttributeProgrammaticStreamSerialization``, Triton's ``launch_pdl``) a kernel
is launched while its predecessor still runs: its programs start, signal that their own
successor may launch (``griddepcontrol.launch_dependents``), load what no earlier kernel
writes (their weights), and only then wait for the predecessor grid to complete and its
memory to be visible (``griddepcontrol.wait``) before reading activations or writing
anything. CUDA graphs keep these launches as programmatic edges.

The contract of a kernel launched with PDL, which :func:`options` switches on:

- it calls :func:`~miles_host.kernels._triton_common.pdl_start` at the top and
  :func:`~miles_host.kernels._triton_common.pdl_wait` before its first read of a tensor an
  earlier kernel of the step writes and before its first store or atomic (the wait orders it
  after the whole chain: a predecessor cannot complete before its own wait returned);
- before the wait it reads only weights (parameters no kernel of the step writes) and the
  step's inputs written before its first kernel (the attention's tiles, query offsets and
  context lengths: the decode graph's first kernel, a plain launch, copies the lengths, so
  every PDL kernel of the step starts after it);
- a program with nothing to read or write may return without waiting (the attention's splits
  past a short context: decided from those inputs alone);
- a kernel may read before its wait what the kernel two before it wrote when the one between
  lets it launch only after its own wait (the expert GEMVs: gate_up triggers after waiting
  for the router, so the down GEMV reads the routing and prefetches its weights early).

Kernels that are not launched with PDL (cuBLAS, PyTorch's own) are ordered as always: they
start after the previous kernel completes. Numerics do not change: the same programs run
the same instructions; only launch timing does (a GPU test checks the bits of a decode with and
without). ``--pdl on`` is the default; ``--pdl off`` launches every kernel plainly.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from miles_host.kernels import switches

#: ``--pdl``: ``on``, the default (the decode kernels launch with programmatic dependent launch where the
#: GPU supports it), or ``off``: on an H100 the Qwen3-30B-A3B-shaped batch-1 decode with the other defaults ran
#: at a median 1,185 tok/s with it against 1,120 without, over five alternating pairs (bench/RESULTS.md)
PDL = switches.declare_host("pdl")

#: the first compute capability with ``griddepcontrol``
MIN_CAPABILITY = (9, 0)


@lru_cache(maxsize=None)
def _supports(device_index: int) -> bool:
    """An NVIDIA GPU with ``griddepcontrol`` (ROCm reports its own architecture numbers as capabilities)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index) >= MIN_CAPABILITY


def enabled(tensor: torch.Tensor) -> bool:
    """Whether kernels on ``tensor``'s device launch with PDL: a CUDA tensor on a GPU of compute
    capability 9.0 or later, ``--pdl on``, and not Triton's interpreter."""
    if not tensor.is_cuda or switches.value(PDL) != "on":
        return False
    import triton

    if triton.knobs.runtime.interpret:
        return False
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    return _supports(index)


def options(tensor: torch.Tensor) -> dict:
    """Launch keywords of a PDL-aware kernel (one taking a ``PDL: tl.constexpr``) for ``tensor``'s
    device: ``PDL`` (its constexpr) and Triton's ``launch_pdl`` compile option, both on or both off."""
    if enabled(tensor):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


__all__ = ["MIN_CAPABILITY", "PDL", "enabled", "options"]
