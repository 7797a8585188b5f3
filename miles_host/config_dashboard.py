"""Flags of the run dashboard and of the torch profiler / CUDA memory snapshots.

``--use-miles-dashboard`` is upstream miles' flag; upstream serves its dashboard as a
separate command (``python -m miles.dashboard.serve --host --port``), here the run serves it
itself, so the address flags are this host's own (``--miles-dashboard-host/-port/-api-key``;
``miles dashboard OUTPUT_DIR ...`` serves finished runs the same way).

The profiler flags are Megatron-LM's (``--use-pytorch-profiler``, ``--profile-step-start``,
``--profile-step-end``, ``--record-memory-history``, ``--memory-snapshot-path``) and upstream
miles' (``--profile-target``, ``--memory-snapshot-dir``, ``--memory-snapshot-num-steps``),
with their defaults. :func:`check_dashboard` checks values and combinations.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles_host.config_fields import flag, optional_int
from miles_host.http_serving import require_key_off_loopback

#: ``--profile-target`` choices (upstream miles'): what a torch profiler trace covers
PROFILE_TARGETS = ("train_overall", "train_actor", "train_log_probs")


@dataclass
class DashboardArgs:
    use_miles_dashboard: bool = flag(False, "serve the run's dashboard while it runs (live curves of every metric, "
                                     "a rollout browser, a timeline of each step's phases) and write each step's "
                                     "samples for it under <--output-dir>/dashboard/samples/", group="output")
    miles_dashboard_host: str = flag("127.0.0.1", "address the --use-miles-dashboard server listens on (anything but "
                                     "loopback needs --miles-dashboard-api-key)", type=str, group="output")
    miles_dashboard_port: int = flag(7788, "port of the --use-miles-dashboard server (0: any free port; the URL is "
                                     "printed)", type=int, group="output")
    miles_dashboard_api_key: str | None = flag(None, "API key of the dashboard: its data endpoints need "
                                               "'Authorization: Bearer KEY' (open the page as /?key=KEY)", type=str,
                                               group="output")
    miles_dashboard_samples_per_step: int = flag(32, "samples of each step written for the dashboard's rollout browser "
                                                 "(whole groups, first ones first; 0: none)", type=int, group="output")


@dataclass
class ProfilingArgs:
    use_pytorch_profiler: bool = flag(False, "write torch profiler traces (TensorBoard trace files, gzipped, under "
                                      "$TENSORBOARD_DIR or <--output-dir>/tensorboard) of rollout steps "
                                      "[--profile-step-start, --profile-step-end) for each --profile-target",
                                      group="debug")
    profile_target: list = flag(["train_overall"], "what the traces cover: train_overall (whole rollout steps: "
                                "rollout, reward, training, weight sync), train_actor (the trainer's call of those "
                                "steps), train_log_probs (the trainer's log-prob passes without gradient of those "
                                "steps); traced in this process (a trainer in worker processes shows as waiting)",
                                type=str, nargs="+", choices=PROFILE_TARGETS, group="debug")
    profile_step_start: int = flag(10, "first rollout step the profiler records (Megatron's default)", type=int,
                                   group="debug")
    profile_step_end: int = flag(12, "rollout step the profiler stops before (Megatron's default)", type=int,
                                 group="debug")
    record_memory_history: bool = flag(False, "record CUDA allocations (torch.cuda.memory._record_memory_history) "
                                       "and dump a snapshot to --memory-snapshot-dir after --memory-snapshot-num-steps "
                                       "rollout steps (default: at the end of the run) and on a CUDA out-of-memory "
                                       "error; view it at pytorch.org/memory_viz (needs CUDA)", group="debug")
    memory_snapshot_dir: str = flag(".", "directory of the --record-memory-history snapshots", type=str, group="debug")
    memory_snapshot_path: str = flag("snapshot.pickle", "file name suffix of the --record-memory-history snapshots",
                                     type=str, group="debug")
    memory_snapshot_num_steps: int | None = flag(None, "dump the memory snapshot after this many rollout steps and "
                                                 "stop recording", type=optional_int, group="debug")


@dataclass
class ObservabilityArgs(DashboardArgs, ProfilingArgs):
    """The flags of this module, one base of :class:`miles_host.config.MilesConfig`."""


def check_dashboard(config) -> None:
    """Values of this module's flags that cannot work; ValueError naming the flag."""
    if not 0 <= config.miles_dashboard_port <= 65535:
        raise ValueError(f"--miles-dashboard-port must be a TCP port (0 for any free one), got "
                         f"{config.miles_dashboard_port}")
    if config.miles_dashboard_samples_per_step < 0:
        raise ValueError(f"--miles-dashboard-samples-per-step must be >= 0, got {config.miles_dashboard_samples_per_step}")
    if config.use_miles_dashboard:
        require_key_off_loopback(config.miles_dashboard_host, config.miles_dashboard_api_key,
                                 "the dashboard (--use-miles-dashboard)", "--miles-dashboard-api-key")
    if config.use_pytorch_profiler and not 0 <= config.profile_step_start < config.profile_step_end:
        raise ValueError(f"--profile-step-start {config.profile_step_start} and --profile-step-end "
                         f"{config.profile_step_end}: the profiler records steps [start, end), so 0 <= start < end")
    bad = [target for target in config.profile_target if target not in PROFILE_TARGETS]
    if bad:
        raise ValueError(f"--profile-target {' '.join(bad)}: choose from {', '.join(PROFILE_TARGETS)}")
    if config.memory_snapshot_num_steps is not None and config.memory_snapshot_num_steps < 1:
        raise ValueError(f"--memory-snapshot-num-steps must be >= 1 rollout step, got {config.memory_snapshot_num_steps}")
