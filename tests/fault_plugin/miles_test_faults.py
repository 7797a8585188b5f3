"""A plugin the tests register (entry point ``faults``): it breaks the rollout engine
process on purpose, so the tests can check how a run stops or recovers.

- ``--test-rollout-die-after-syncs N``: the engine process kills itself (SIGKILL) at
  its first ``step`` after N weight updates (2 = in the second rollout: the initial
  sync, then one);
- ``--test-rollout-hang-after-syncs N``: it hangs there instead;
- ``--test-engine-kill I:N`` (repeatable): engine ``I`` kills itself (SIGKILL) at its
  first ``step`` after it accepted N requests; ``--test-engine-stop I:N`` stops itself
  there (SIGSTOP). Only the engine the run started does: a restarted one
  (``RolloutProcess.incarnation > 0``) runs unbroken.

``miles_process_start`` fires in every engine process once its plugin manager is
rebuilt; the plugin wraps :meth:`RolloutProcess.step` and ``submit`` of that process.
"""

from __future__ import annotations

import os
import signal
import time

from miles_host.distributed.rollout_worker import RolloutProcess

_UNBROKEN_STEP = RolloutProcess.step
_UNBROKEN_SUBMIT = RolloutProcess.submit


def miles_add_arguments(parser):
    group = parser.add_argument_group("faults (test plugin)")
    group.add_argument("--test-rollout-die-after-syncs", type=int, default=0,
                       help="SIGKILL the engine process at its first step after N weight updates")
    group.add_argument("--test-rollout-hang-after-syncs", type=int, default=0,
                       help="hang the engine process at its first step after N weight updates")
    group.add_argument("--test-engine-kill", action="append", default=[], metavar="I:N",
                       help="SIGKILL engine I (not a restarted one) at its first step after it accepted N requests")
    group.add_argument("--test-engine-stop", action="append", default=[], metavar="I:N",
                       help="SIGSTOP engine I (not a restarted one) at its first step after it accepted N requests")


def _targets(values) -> dict[int, int]:
    """``["0:3", "1:5"]`` -> ``{0: 3, 1: 5}``."""
    return {int(index): int(count) for index, count in (value.split(":") for value in values or [])}


def miles_process_start(config):
    die_after = config.plugin_args.get("test_rollout_die_after_syncs") or 0
    hang_after = config.plugin_args.get("test_rollout_hang_after_syncs") or 0
    by_signal = {signal.SIGKILL: _targets(config.plugin_args.get("test_engine_kill")),
                 signal.SIGSTOP: _targets(config.plugin_args.get("test_engine_stop"))}

    def submit(self, *args, **kwargs):
        result = _UNBROKEN_SUBMIT(self, *args, **kwargs)
        self.accepted_requests = getattr(self, "accepted_requests", 0) + 1
        return result

    def step(self):
        if die_after and self.syncs >= die_after:
            os.kill(os.getpid(), signal.SIGKILL)
        if hang_after and self.syncs >= hang_after:
            while True:
                time.sleep(3600)
        if self.incarnation == 0:
            for signum, targets in by_signal.items():
                count = targets.get(self.index)
                if count and getattr(self, "accepted_requests", 0) >= count:
                    os.kill(os.getpid(), signum)
        return _UNBROKEN_STEP(self)

    broken = die_after or hang_after or any(by_signal.values())
    RolloutProcess.step = step if broken else _UNBROKEN_STEP
    RolloutProcess.submit = submit if broken else _UNBROKEN_SUBMIT
