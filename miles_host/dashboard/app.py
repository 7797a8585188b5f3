"""The dashboard's FastAPI app: the page, its static files and the JSON it reads.

- ``GET /`` the page; ``GET /static/...`` its scripts, styles and the vendored uPlot;
- ``GET /api/runs`` the runs (re-scanned each call, so runs started later appear);
- ``GET /api/runs/{run}/metrics?offset=N`` the metrics records after byte ``N`` of
  metrics.jsonl and the next offset (the page polls it to follow a live run);
- ``GET /api/runs/{run}/samples`` steps with samples; ``/samples/{step}`` their records;
- ``GET /api/runs/{run}/timeline`` each step's phase durations.

With an API key (needed off loopback: :func:`miles_host.http_serving.require_key_off_loopback`)
every ``/api`` path needs ``Authorization: Bearer <key>``; the page and its static files hold no
run data and stay open (the page sends the key given as ``/?key=...``).
"""

from __future__ import annotations

from http import HTTPStatus
from pathlib import Path
from typing import Any, Callable

from miles_host.dashboard.runs import RunDir, find_runs
from miles_host.http_serving import bearer_matches

STATIC_DIR = Path(__file__).parent / "static"


def build_app(list_runs: Callable[[], list[RunDir]], api_key: str | None = None) -> Any:
    """The FastAPI app over the runs ``list_runs()`` returns (called per request)."""
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import FileResponse, JSONResponse
    from fastapi.staticfiles import StaticFiles

    app = FastAPI(title="miles dashboard", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        authorization = request.headers.get("authorization")
        if request.url.path.startswith("/api") and not bearer_matches(
                api_key, None if authorization is None else authorization.encode("latin-1")):
            return JSONResponse({"error": "Unauthorized"}, status_code=HTTPStatus.UNAUTHORIZED)
        return await call_next(request)

    def run(run_id: str) -> RunDir:
        for candidate in list_runs():
            if candidate.run_id == run_id:
                return candidate
        raise HTTPException(HTTPStatus.NOT_FOUND, f"no run {run_id!r}")

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-store"})

    @app.get("/api/runs")
    def runs() -> list[dict]:
        return [candidate.summary() for candidate in list_runs()]

    @app.get("/api/runs/{run_id}/metrics")
    def metrics(run_id: str, offset: int = 0) -> dict:
        return run(run_id).metrics_since(max(offset, 0))

    @app.get("/api/runs/{run_id}/samples")
    def sample_steps(run_id: str) -> list[int]:
        return run(run_id).sample_steps()

    @app.get("/api/runs/{run_id}/samples/{rollout_id}")
    def samples(run_id: str, rollout_id: int) -> list[dict]:
        try:
            return run(run_id).samples(rollout_id)
        except FileNotFoundError as error:
            raise HTTPException(HTTPStatus.NOT_FOUND, str(error)) from error

    @app.get("/api/runs/{run_id}/timeline")
    def timeline(run_id: str) -> list[dict]:
        return run(run_id).timeline()

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app


def app_for_dirs(paths: list[str | Path], api_key: str | None = None) -> Any:
    """The app over the runs found under ``paths`` (:func:`find_runs`, checked once here)."""
    find_runs(paths)  # a missing directory is an error now, not at the first request
    return build_app(lambda: find_runs(paths), api_key)
