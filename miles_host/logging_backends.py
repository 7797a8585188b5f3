"""Metric loggers: metrics.jsonl (always), TensorBoard and wandb when installed."""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

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
        fresh_metrics_file(self.path, resuming=bool(config.load))

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


class TensorBoardLogger(MetricsLoggerBase):
    """TensorBoard event files under ``<output_dir>/tensorboard`` (needs tensorboard)."""

    def __init__(self, config: Any):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            warnings.warn("--use-tensorboard: tensorboard is not installed (pip install tensorboard); not logging there")
            self.writer = None
            return
        self.writer = SummaryWriter(str(Path(config.output_dir) / "tensorboard"))

    def log(self, metrics: dict, step: int) -> None:
        if self.writer is None:
            return
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbLogger(MetricsLoggerBase):
    """Weights & Biases (needs wandb and a login)."""

    def __init__(self, config: Any):
        try:
            import wandb
        except ImportError:
            warnings.warn("--use-wandb: wandb is not installed (pip install wandb); not logging there")
            self.run = None
            return
        self.run = wandb.init(project=config.wandb_project or "miles", config=config.to_dict(), dir=config.output_dir)

    def log(self, metrics: dict, step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
