"""miles-fp8's kernel switches (``miles run`` flags, recorded in the run's config.json;
see :mod:`miles_host.kernels.switches`)."""

from __future__ import annotations

from miles_host.kernels.switches import declare

#: GEMM of the quantized operands on CUDA
GEMM = declare("fp8_gemm", "auto", ("auto", "triton", "scaled_mm", "reference"),
               "FP8 GEMM on CUDA: auto (cuBLAS block-scaled _scaled_mm when usable, else Triton), triton, "
               "scaled_mm, reference (plain PyTorch)")
#: most token rows of the fused small-M kernel (0: off; capped at 64)
SMALL_M = declare("fp8_small_m", 64, None,
                  "most token rows the fused small-M FP8 kernel takes (0 turns it off; at most 64)")
#: 1: the small-M kernel multiplies on FP8 tensor cores; 0: fp16 products, fp32 sums
SMALL_M_MMA = declare("fp8_small_m_mma", 1, (0, 1),
                      "small-M FP8 kernel products: 1 on FP8 tensor cores, 0 in fp16 with fp32 sums")
#: 1: the plain-PyTorch path on the GPU too (debugging)
REFERENCE = declare("fp8_reference", 0, (0, 1), "1: plain-PyTorch FP8 path on the GPU too (debugging)")

SWITCHES = (GEMM, SMALL_M, SMALL_M_MMA, REFERENCE)
