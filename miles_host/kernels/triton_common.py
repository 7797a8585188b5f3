"""The Triton building blocks that plugins' kernels share with the host's (needs triton).

The public face of the host's private ``_*_triton`` modules: plugins (miles-fp8,
miles-int4) import these names from here, so the host can reorganise its kernels
without breaking them. Every name is a ``triton.jit`` function or a constant:

- rounding: :func:`cast_rne` (float32 -> bf16/fp16 rounding to nearest even, or its
  emulation under the interpreter), :func:`emulate_rounding` (whether to emulate),
  :func:`cast` / :func:`round_to`;
- GEMM pieces: :func:`dot` (tensor-core or emulated product), :func:`split_k_epilogue`
  (the deterministic split-K reduction), :func:`grouped_tile` (grouped tile order),
  :func:`mma` (the grouped MoE GEMM's product);
- grouped MoE: :data:`ACTIVATIONS` (activation name -> kernel code),
  :func:`act_and_mul` (``act(gate) * up`` in an epilogue; code 3, gpt-oss' clamped SwiGLU, takes
  ``LIMIT`` and ``ALPHA``), :func:`block_rows` (the rows
  of one block of the expert-sorted layout).
"""

from __future__ import annotations

from miles_host.kernels._moe_grouped_triton import ACTIVATIONS, act_and_mul, block_rows
from miles_host.kernels._moe_grouped_triton import _mma as mma
from miles_host.kernels._split_k_triton import cast_rne, dot, emulate_rounding, split_k_epilogue
from miles_host.kernels._triton_common import cast, grouped_tile, round_to

__all__ = [
    "ACTIVATIONS",
    "act_and_mul",
    "block_rows",
    "cast",
    "cast_rne",
    "dot",
    "emulate_rounding",
    "grouped_tile",
    "mma",
    "round_to",
    "split_k_epilogue",
]
