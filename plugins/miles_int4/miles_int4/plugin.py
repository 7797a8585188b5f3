"""miles-int4 (entry point ``int4``): INT4 QAT with INT4 rollout weights.

Selecting the plugin makes ``int4`` the run's precision recipe. The recipe itself
is issue [8/13]; until it lands, a run that needs it stops with "unknown
precision 'int4'".
"""

from __future__ import annotations


def miles_add_arguments(parser):
    """INT4 flags."""
    group = parser.add_argument_group("int4 (plugin)")
    group.add_argument("--int4-group-size", type=int, default=128, choices=[32, 64, 128], help="weights per scale group")
    group.add_argument(
        "--int4-target", default="experts", choices=["experts", "all"], help="which linears are quantised"
    )


def miles_configure(config):
    """An active int4 plugin selects the ``int4`` precision recipe."""
    config.precision = "int4"
