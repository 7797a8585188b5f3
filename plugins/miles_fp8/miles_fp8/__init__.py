"""miles-fp8: unified block-scaled FP8 (E4M3, 1x128 activations, 128x128 weights) for rollout and training.

Public API: :mod:`miles_fp8.quant` (quantize / dequantize), :mod:`miles_fp8.gemm`
(``block_scaled_mm``), :mod:`miles_fp8.linear` (``Fp8Linear``, ``Fp8InferenceLinear``),
:mod:`miles_fp8.experts`, :mod:`miles_fp8.recipe` (the ``fp8`` Precision callables),
:mod:`miles_fp8.convert` (``convert_checkpoint``).
"""
