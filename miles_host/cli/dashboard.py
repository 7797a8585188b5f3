"""``miles dashboard [OUTPUT_DIR ...]``: serve the dashboard over finished or running runs."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

#: upstream miles serves its dashboard on this port (``python -m miles.dashboard.serve``)
DEFAULT_PORT = 7788


def cmd_dashboard(argv: Sequence[str]) -> int:
    """Serve until interrupted (Ctrl-C)."""
    from miles_host.dashboard.server import page_url, serve_dashboard

    parser = argparse.ArgumentParser(
        prog="miles dashboard",
        description="Serve the dashboard (metrics, rollouts, step timeline) of miles runs; several runs are "
                    "compared on the same curves. A run still running is followed live.")
    parser.add_argument("output_dirs", nargs="*", default=["outputs"], metavar="OUTPUT_DIR",
                        help="run output directories (--output-dir of miles run), or folders holding them "
                             "(default: outputs)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; any other "
                                                            "needs --api-key)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: a free one)")
    parser.add_argument("--api-key", default=None, help="API key the page's data requests must carry "
                                                       "(open the page as /?key=KEY)")
    args = parser.parse_args(list(argv))
    try:
        server = serve_dashboard(args.output_dirs, args.host, args.port, args.api_key)
    except OSError as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise ValueError(str(error)) from error
    print(f"miles: dashboard at {page_url(server)} (Ctrl-C to stop)", file=sys.stderr, flush=True)
    try:
        while server.thread.is_alive():
            server.thread.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
