"""miles-int4: INT4 quantization-aware training with INT4 rollout weights.

Modules: :mod:`~miles_int4.quant` (the INT4 formula, packing), :mod:`~miles_int4.targets`
(which weights), :mod:`~miles_int4.qat` (training), :mod:`~miles_int4.rollout` and
:mod:`~miles_int4.kernels` (rollout), :mod:`~miles_int4.convert` (checkpoints),
:mod:`~miles_int4.memory` (``miles memory``), :mod:`~miles_int4.plugin` (the hooks).
"""
