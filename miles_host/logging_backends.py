"""Metric loggers: metrics.jsonl (always), TensorBoard and wandb when installed."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class JsonlLogger:
    """One JSON object per rollout step in ``<output_dir>/metrics.jsonl``."""

    def __init__(self, config: Any):
        self.path = Path(config.output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, metrics: dict, step: int) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps({k: _jsonable(v) for k, v in metrics.items()}) + "\n")

    def close(self) -> None:
        pass


class TensorBoardLogger:
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


class WandbLogger:
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
