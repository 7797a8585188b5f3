"""Built-in plugin: off-policy corrections TIS, MIS and icepop.

The math lives in :mod:`miles_host.algorithms.corrections`; this module
registers each under a name and says which flags switch it on.
"""

from __future__ import annotations

from miles_host.records import Correction


def _correction(name):
    def correct(train_log_probs, rollout_log_probs, loss_mask, response_lengths, config):
        from miles_host.algorithms.corrections import CORRECTIONS

        return CORRECTIONS[name](train_log_probs, rollout_log_probs, loss_mask, response_lengths, config)

    return correct


def miles_register_corrections():
    """The host's corrections."""
    return [
        Correction("tis", "truncated importance sampling (--use-tis)", fn=_correction("tis"), enabled=lambda c: c.use_tis),
        Correction("mis", "masked importance sampling (--use-mis)", fn=_correction("mis"), enabled=lambda c: c.use_mis),
        Correction("icepop", "mask tokens with extreme ratios (--use-icepop)", fn=_correction("icepop"), enabled=lambda c: c.use_icepop),
    ]
