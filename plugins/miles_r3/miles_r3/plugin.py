"""miles-r3 (entry point ``r3``): rollout routing replay for MoE models.

Activated by ``--plugins r3`` or by slime's ``--use-rollout-routing-replay`` /
``--use-routing-replay``. Capture and replay through the routing hooks are issue
[6/13].
"""

from __future__ import annotations


def miles_add_arguments(parser):
    """slime's routing-replay flags."""
    group = parser.add_argument_group("r3 (plugin)")
    group.add_argument(
        "--use-rollout-routing-replay", action="store_true", help="R3: replay the rollout's experts in training"
    )
    group.add_argument(
        "--use-routing-replay", action="store_true", help="R2: record in the old-logprob pass, replay in training"
    )


def miles_activate(args):
    """slime's flags switch R3 on without --plugins."""
    return bool(getattr(args, "use_rollout_routing_replay", False) or getattr(args, "use_routing_replay", False))


def miles_configure(config):
    """``--plugins r3`` alone means rollout routing replay."""
    if not config.plugin_args.get("use_routing_replay"):
        config.plugin_args["use_rollout_routing_replay"] = True
