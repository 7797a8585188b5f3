"""Built-in plugin: off-policy corrections TIS, MIS and icepop.

The math and the records (which flag switches each on) live in
:mod:`miles_host.algorithms.corrections`; this module registers them.
"""

from __future__ import annotations


def miles_register_corrections():
    """The host's corrections."""
    from miles_host.algorithms.corrections import CORRECTION_RECORDS

    return list(CORRECTION_RECORDS)
