"""miles-int4's kernel switches (``miles run`` flags, recorded in the run's config.json;
see :mod:`miles_host.kernels.switches`)."""

from __future__ import annotations

from miles_host.kernels.switches import declare

#: the rollout weight layout on CUDA (``tinygemm``: torch's kernel, kept for comparisons)
CUDA_LAYOUT = declare("int4_cuda_layout", "halves", ("halves", "tinygemm"),
                      "INT4 rollout weight layout on CUDA: halves (the Triton kernels), or tinygemm (torch's kernel)")
#: 1: ``halves`` weights stored in tiles of 128 rows when they divide N; 0: as rows
TILE_ROWS = declare("int4_tile_rows", 1, (0, 1),
                    "1: INT4 halves weights stored in tiles of 128 rows (when they divide N); 0: as rows")
#: most token rows of the Triton small-M kernel (0: off; capped at 64)
SMALL_M = declare("int4_small_m", 64, None,
                  "most token rows the INT4 Triton small-M kernel takes (0 turns it off; at most 64)")
#: 1: one-token inputs take the CUDA-core GEMV; 0: the tensor-core kernel too
GEMV = declare("int4_gemv", 1, (0, 1), "1: one-token INT4 inputs take the CUDA-core GEMV; 0: the tensor-core kernel")

#: most tokens whose MoE experts take the CUDA-core grouped GEMV (a program row per (token, slot) pair; 0: off)
MOE_GEMV_TOKENS = declare("int4_moe_gemv_tokens", 1, None,
                          "most tokens whose INT4 MoE experts take the CUDA-core grouped GEMV, one program row per "
                          "(token, slot) pair (0: the tensor-core kernel always)")

SWITCHES = (CUDA_LAYOUT, TILE_ROWS, SMALL_M, GEMV, MOE_GEMV_TOKENS)
