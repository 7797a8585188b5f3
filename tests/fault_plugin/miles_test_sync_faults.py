"""A plugin the tests register (entry point ``sync_faults``): it breaks trainer and engine
processes around weight sync and training on purpose, so the tests can check that each
failure stops the run the same way (exit 3, the worker named, a checkpoint).

- ``--test-rollout-die-in-broadcast N`` / ``--test-rollout-stop-in-broadcast N``: the
  engine process kills itself (SIGKILL) / stops itself (SIGSTOP) as it starts to receive
  its N-th weight update (1 = the initial sync, 2 = the one after the first rollout); a
  restarted engine (``--use-fault-tolerance``) does not;
- ``--test-trainer-die-at-train N`` / ``--test-trainer-stop-at-train N``: trainer rank 1
  does the same at its N-th ``train`` (1 = the first rollout's);
- ``--test-trainer-die-at-start``: trainer rank 1 kills itself before it joins the
  trainers' process group.

``miles_process_start`` fires in every worker process once its plugin manager is rebuilt;
the plugin wraps the methods of that process only.
"""

from __future__ import annotations

import multiprocessing
import os
import signal

from miles_host.distributed.rollout_worker import RolloutProcess
from miles_host.distributed.trainer_group import _TrainerTarget

_RECEIVE_BROADCAST = RolloutProcess.receive_broadcast
_TRAIN = _TrainerTarget.train


def miles_add_arguments(parser):
    group = parser.add_argument_group("sync faults (test plugin)")
    for name, what in (
        ("--test-rollout-die-in-broadcast", "SIGKILL the engine process as its N-th weight update starts"),
        ("--test-rollout-stop-in-broadcast", "SIGSTOP the engine process as its N-th weight update starts"),
        ("--test-trainer-die-at-train", "SIGKILL trainer rank 1 at its N-th train"),
        ("--test-trainer-stop-at-train", "SIGSTOP trainer rank 1 at its N-th train"),
    ):
        group.add_argument(name, type=int, default=0, help=what)
    group.add_argument("--test-trainer-die-at-start", action="store_true",
                       help="SIGKILL trainer rank 1 before it joins the process group")


def _signal_at(count: int, kill: int, stop: int) -> None:
    if kill and count == kill:
        os.kill(os.getpid(), signal.SIGKILL)
    if stop and count == stop:
        os.kill(os.getpid(), signal.SIGSTOP)


def miles_process_start(config):
    args = config.plugin_args
    trainer_one = multiprocessing.current_process().name == "trainer-1"
    if trainer_one and args.get("test_trainer_die_at_start"):
        os.kill(os.getpid(), signal.SIGKILL)
    kill_rollout, stop_rollout = args.get("test_rollout_die_in_broadcast"), args.get("test_rollout_stop_in_broadcast")
    kill_trainer, stop_trainer = args.get("test_trainer_die_at_train"), args.get("test_trainer_stop_at_train")
    trains = {"n": 0}

    def receive_broadcast(self, buckets_meta, weight_version):
        if self.incarnation == 0:
            _signal_at(self.syncs + 1, kill_rollout, stop_rollout)
        return _RECEIVE_BROADCAST(self, buckets_meta, weight_version)

    def train(self, samples):
        trains["n"] += 1
        _signal_at(trains["n"], kill_trainer, stop_trainer)
        return _TRAIN(self, samples)

    RolloutProcess.receive_broadcast = receive_broadcast if (kill_rollout or stop_rollout) else _RECEIVE_BROADCAST
    _TrainerTarget.train = train if (trainer_one and (kill_trainer or stop_trainer)) else _TRAIN
