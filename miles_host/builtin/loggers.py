"""Built-in plugin: metric loggers (jsonl always; TensorBoard, wandb when asked
for and installed; the dashboard server with ``--use-miles-dashboard``)."""

from __future__ import annotations

from miles_host.records import Logger


def _jsonl(config):
    from miles_host.logging_backends import JsonlLogger

    return JsonlLogger(config)


def _tensorboard(config):
    from miles_host.logging_backends import TensorBoardLogger

    return TensorBoardLogger(config)


def _wandb(config):
    from miles_host.logging_backends import WandbLogger

    return WandbLogger(config)


def _dashboard(config):
    from miles_host.dashboard.server import DashboardLogger

    return DashboardLogger(config)


def miles_register_loggers():
    """The host's loggers."""
    return [
        Logger("jsonl", "metrics.jsonl in --output-dir", factory=_jsonl),
        Logger("tensorboard", "TensorBoard event files", factory=_tensorboard, enabled=lambda c: c.use_tensorboard),
        Logger("wandb", "Weights & Biases", factory=_wandb, enabled=lambda c: c.use_wandb),
        Logger("dashboard", "the run's dashboard, served while it runs", factory=_dashboard,
               enabled=lambda c: c.use_miles_dashboard),
    ]
