"""miles-spec (entry point ``spec``): speculative rollout with an online-trained draft.

Activated by ``--plugins spec`` or by the seed's ``--sglang-speculative-algorithm``
/ ``--enable-mtp-training`` flags (declared by the host for slime compatibility).
The EAGLE/MTP decoding strategy and the MTP loss term are issue [9/13]; until
they land a run that needs them stops with "unknown decoding strategy".
"""

from __future__ import annotations


def miles_activate(args):
    """The seed's speculative flags switch the plugin on."""
    return bool(args.sglang_speculative_algorithm or args.enable_mtp_training)
