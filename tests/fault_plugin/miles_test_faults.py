"""A plugin the tests register (entry point ``faults``): it breaks the rollout engine
process on purpose, so the tests can check how a run stops.

- ``--test-rollout-die-after-syncs N``: the engine process kills itself (SIGKILL) at
  its first ``step`` after N weight updates (2 = in the second rollout: the initial
  sync, then one);
- ``--test-rollout-hang-after-syncs N``: it hangs there instead.

``miles_process_start`` fires in every engine process once its plugin manager is
rebuilt; the plugin wraps :meth:`RolloutProcess.step` of that process.
"""

from __future__ import annotations

import os
import signal
import time

from miles_host.distributed.rollout_worker import RolloutProcess

_UNBROKEN_STEP = RolloutProcess.step


def miles_add_arguments(parser):
    group = parser.add_argument_group("faults (test plugin)")
    group.add_argument("--test-rollout-die-after-syncs", type=int, default=0,
                       help="SIGKILL the engine process at its first step after N weight updates")
    group.add_argument("--test-rollout-hang-after-syncs", type=int, default=0,
                       help="hang the engine process at its first step after N weight updates")


def miles_process_start(config):
    die_after = config.plugin_args.get("test_rollout_die_after_syncs") or 0
    hang_after = config.plugin_args.get("test_rollout_hang_after_syncs") or 0

    def step(self):
        if die_after and self.syncs >= die_after:
            os.kill(os.getpid(), signal.SIGKILL)
        if hang_after and self.syncs >= hang_after:
            while True:
                time.sleep(3600)
        return _UNBROKEN_STEP(self)

    RolloutProcess.step = step if (die_after or hang_after) else _UNBROKEN_STEP
