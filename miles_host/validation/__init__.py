"""The one validation stage: every check of a run's settings, before anything starts.

:func:`validate` runs in ``miles run``, ``miles run --dry-run``, ``python train.py``
and :class:`miles_host.loop.Run` (the Python API) alike, so a config that
``--dry-run`` accepts (exit 0) is one the run starts with, and a config the run
refuses is refused by ``--dry-run`` with the same message and exit code.

Where to add a check (raise ``ValueError``, or ``FileNotFoundError`` for a missing
file, with a message that names the flag and says what to do; the CLI turns either
into exit code 2):

- one value, or a combination of values, that needs nothing but the config
  (``--clip-grad`` must be positive, two flags that exclude each other):
  :func:`miles_host.config.validate_config` (it also runs whenever a
  ``MilesConfig`` is built);
- a check that needs the registries, the file system or the machine (a path
  exists, a placement fits the GPUs, a flag needs a plugin): a function
  ``check_*(config, registries)`` in :mod:`miles_host.validation.host_checks`,
  listed in its ``HOST_CHECKS``;
- a check that belongs to one backend, precision, transport, estimator, decoding
  strategy, correction or loss term: the ``validate(config, registries)`` field
  of its record (:class:`miles_host.records.Record`); it runs only when the run
  selects or enables that record;
- a plugin's own flags: the plugin's ``miles_validate(config, registries)`` hook;
- a flag kept only so slime scripts parse: an entry of
  :data:`miles_host.validation.ignored_flags.ACCEPTED_AND_IGNORED` (one warning
  when set), never silence.
"""

from __future__ import annotations

from typing import Any

from miles_host.config import validate_config
from miles_host.validation.host_checks import HOST_CHECKS
from miles_host.validation.ignored_flags import ACCEPTED_AND_IGNORED, warn_ignored_flags
from miles_host.validation.plugin_settings import configure_with_plugins, user_set_fields
from miles_host.validation.record_checks import selected_records

__all__ = [
    "ACCEPTED_AND_IGNORED",
    "HOST_CHECKS",
    "configure_with_plugins",
    "selected_records",
    "user_set_fields",
    "validate",
]


def validate(config: Any, registries: Any, hook: Any = None) -> None:
    """Refuse, with a ValueError / FileNotFoundError naming the flag, any setting the
    run cannot honour; warn once for each accepted-and-ignored slime flag that is set.

    Order: value checks, host checks, the selected records' ``validate``, then the
    plugins' ``miles_validate`` hook (``hook``: the plugin manager's hook relay)."""
    validate_config(config)
    for check in HOST_CHECKS:
        check(config, registries)
    for record in selected_records(config, registries):
        if record.validate is not None:
            record.validate(config, registries)
    if hook is not None:
        hook.miles_validate(config=config, registries=registries)
    warn_ignored_flags(config, honoured=registries.train_backends.get(config.train_backend).honoured_flags)
