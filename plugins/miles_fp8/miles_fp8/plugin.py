"""miles-fp8 (entry point ``fp8``): unified block-scaled FP8 for rollout and training.

Selecting the plugin makes ``fp8`` the run's precision recipe. The recipe itself
(quantize kernels, FP8 GEMMs, ``miles convert --to fp8``) is issue [7/13]; until
it lands, a run that needs it stops with "unknown precision 'fp8'".
"""

from __future__ import annotations


def miles_add_arguments(parser):
    """FP8 flags (Megatron / slime spellings)."""
    group = parser.add_argument_group("fp8 (plugin)")
    group.add_argument("--fp8-format", default="e4m3", choices=["e4m3", "hybrid"], help="FP8 format")
    group.add_argument("--fp8-recipe", default="blockwise", choices=["blockwise"], help="FP8 scaling recipe")
    group.add_argument(
        "--fp8-power-of-two-scales", action="store_true", help="round FP8 scales to powers of two"
    )


def miles_configure(config):
    """An active fp8 plugin selects the ``fp8`` precision recipe."""
    config.precision = "fp8"
