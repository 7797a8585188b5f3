"""Metric loggers: metrics.jsonl (always), TensorBoard and wandb when installed."""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import warnings
from pathlib import Path
from typing import Any

from miles_host.checkpoint import has_checkpoint
from miles_host.protocols import MetricsLoggerBase
from miles_host.run_control import fresh_metrics_file, write_error


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class JsonlLogger(MetricsLoggerBase):
    """One JSON object per rollout step in ``<output_dir>/metrics.jsonl``.

    The record of last resort: the loop stops when it cannot be written (``required``).
    A line is written whole or not at all (a failed write is cut off again), and a
    file left by an earlier run in the same ``--output-dir`` is kept under another
    name unless this run resumes it (:func:`miles_host.run_control.fresh_metrics_file`)."""

    required = True

    def __init__(self, config: Any):
        self.path = Path(config.output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fresh_metrics_file(self.path, resuming=has_checkpoint(config.load))

    def log(self, metrics: dict, step: int) -> None:
        line = (json.dumps({k: _jsonable(v) for k, v in metrics.items()}) + "\n").encode()
        with self.path.open("ab", buffering=0) as handle:
            size = handle.seek(0, os.SEEK_END)
            try:
                self._write(handle, line)
            except OSError as error:
                with contextlib.suppress(OSError):
                    handle.truncate(size)  # no torn last line
                raise write_error("metrics.jsonl", self.path, error) from error

    @staticmethod
    def _write(handle: Any, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[handle.write(view):]

    def close(self) -> None:
        pass


def tensorboard_dir(config: Any) -> Path:
    """Where TensorBoard's event files go: ``$TENSORBOARD_DIR`` (slime's variable) or
    ``<output_dir>/tensorboard``, then ``--tb-project-name`` / ``--tb-experiment-name`` when given."""
    root = Path(os.environ.get("TENSORBOARD_DIR") or Path(config.output_dir) / "tensorboard")
    for part in (config.tb_project_name, config.tb_experiment_name):
        if part:
            root = root / part
    return root


def wandb_init_kwargs(config: Any, suffix: str | None = None) -> dict[str, Any]:
    """``wandb.init`` arguments from the wandb flags: project, entity (``--wandb-team``), group,
    a run name (the group and a random suffix, as slime names runs, unless
    ``--disable-wandb-random-suffix``), ``--wandb-run-id`` resumed, mode and directory."""
    kwargs: dict[str, Any] = {"project": config.wandb_project or "miles", "dir": config.wandb_dir or config.output_dir}
    if config.wandb_team:
        kwargs["entity"] = config.wandb_team
    if config.wandb_group:
        kwargs["group"] = config.wandb_group
        random_suffix = suffix if suffix is not None else secrets.token_hex(3)
        kwargs["name"] = config.wandb_group if config.disable_wandb_random_suffix else f"{config.wandb_group}_{random_suffix}"
    if config.wandb_run_id:
        kwargs["id"] = config.wandb_run_id
        kwargs["resume"] = "allow"
    if config.wandb_mode:
        kwargs["mode"] = config.wandb_mode
    return kwargs


class TensorBoardLogger(MetricsLoggerBase):
    """TensorBoard event files under :func:`tensorboard_dir` (needs tensorboard)."""

    def __init__(self, config: Any):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            warnings.warn("--use-tensorboard: tensorboard is not installed (pip install tensorboard); not logging there")
            self.writer = None
            return
        self.writer = SummaryWriter(str(tensorboard_dir(config)))

    def log(self, metrics: dict, step: int) -> None:
        if self.writer is None:
            return
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and key != "rollout_id":  # the step itself
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbLogger(MetricsLoggerBase):
    """Weights & Biases (needs wandb): logs in with ``--wandb-key`` (at ``--wandb-host``) when
    given and the mode is online, and starts the run with :func:`wandb_init_kwargs`."""

    def __init__(self, config: Any):
        try:
            import wandb
        except ImportError:
            warnings.warn("--use-wandb: wandb is not installed (pip install wandb); not logging there")
            self.run = None
            return
        if (config.wandb_key or config.wandb_host) and config.wandb_mode not in ("offline", "disabled"):
            wandb.login(key=config.wandb_key, host=config.wandb_host)
        if config.wandb_dir:
            Path(config.wandb_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(config=config.to_dict(), **wandb_init_kwargs(config))
        if self.run is not None:
            # wandb's own step only grows; the evaluation before training is rollout -1, so
            # rollout_id is the x-axis of every metric instead
            self.run.define_metric("rollout_id")
            self.run.define_metric("*", step_metric="rollout_id")

    def log(self, metrics: dict, step: int) -> None:
        if self.run is not None:
            self.run.log({"rollout_id": step, **metrics})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
