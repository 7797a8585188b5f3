"""Serving the dashboard: over directories (``miles dashboard``) or a run's own output
directory while it runs (``--use-miles-dashboard``, as a metrics logger)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from miles_host.dashboard.app import app_for_dirs, build_app
from miles_host.dashboard.runs import RunDir
from miles_host.http_serving import ThreadedServer, require_key_off_loopback, serve_in_thread
from miles_host.protocols import MetricsLoggerBase


def serve_dashboard(paths: list[str | Path], host: str = "127.0.0.1", port: int = 7788,
                    api_key: str | None = None) -> ThreadedServer:
    """Serve the dashboard over the runs under ``paths`` from a daemon thread (ValueError off
    loopback without a key; FileNotFoundError for a path that is not a directory)."""
    require_key_off_loopback(host, api_key, "the dashboard", "--api-key")
    return serve_in_thread(app_for_dirs(paths, api_key), host, port, "miles-dashboard")


def page_url(server: ThreadedServer) -> str:
    """The page's address (what a user opens; with a key, as ``/?key=KEY``)."""
    return server.url + "/"


class DashboardLogger(MetricsLoggerBase):
    """``--use-miles-dashboard``: serves the dashboard over this run's ``--output-dir`` from the
    run's start to its end (the page reads metrics.jsonl and the sample files as they grow)."""

    def __init__(self, config: Any):
        path = Path(config.output_dir)
        run = RunDir(path.name or "run", path.resolve())
        require_key_off_loopback(config.miles_dashboard_host, config.miles_dashboard_api_key,
                                 "the dashboard (--use-miles-dashboard)", "--miles-dashboard-api-key")
        try:
            self.server = serve_in_thread(build_app(lambda: [run], config.miles_dashboard_api_key),
                                          config.miles_dashboard_host, config.miles_dashboard_port, "miles-dashboard")
        except OSError as error:
            raise ValueError(f"--use-miles-dashboard: {error}; give --miles-dashboard-port another port "
                             "(0: any free one)") from error
        print(f"miles: dashboard at {page_url(self.server)}", file=sys.stderr, flush=True)

    @property
    def url(self) -> str:
        return page_url(self.server)

    def log(self, metrics: dict, step: int) -> None:
        pass  # the page reads metrics.jsonl, which the jsonl logger writes

    def close(self) -> None:
        self.server.stop()
