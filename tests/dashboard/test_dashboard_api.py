"""The dashboard's JSON API over run directories: metrics tailed from a byte offset, sample
files, the step timeline, the API key off loopback, the ``miles dashboard`` command's errors."""

from __future__ import annotations

import json
import math

import pytest
from fastapi.testclient import TestClient

from miles_host.cli.main import main
from miles_host.config import MilesConfig
from miles_host.dashboard.app import app_for_dirs
from miles_host.dashboard.runs import PHASE_METRICS
from miles_host.http_serving import require_key_off_loopback
from tests.dashboard.conftest import RunWriter, read_metrics


def test_metrics_tail_samples_and_timeline(tmp_path, tokenizer):
    run = RunWriter(tmp_path / "a", tokenizer, sample_steps=(1,))
    written = run.write_steps(range(3))
    client = TestClient(app_for_dirs([tmp_path]))
    (summary,) = client.get("/api/runs").json()
    assert (summary["id"], summary["sample_steps"]) == ("a", [1])

    first = client.get("/api/runs/a/metrics?offset=0").json()
    assert first["offset"] == (tmp_path / "a" / "metrics.jsonl").stat().st_size
    expected = read_metrics(tmp_path / "a")
    assert first["records"] == expected  # a NaN as the jsonl logger wrote it: "nan", no point of a curve
    assert first["records"][2]["train/grad_norm"] == "nan" and math.isnan(written[2]["train/grad_norm"])
    with (tmp_path / "a" / "metrics.jsonl").open("a") as handle:  # a writer that left a bare NaN: null
        handle.write('{"rollout_id": 3, "train/loss": NaN}\n')
    bare = client.get(f"/api/runs/a/metrics?offset={first['offset']}").json()
    assert bare["records"] == [{"rollout_id": 3, "train/loss": None}]
    first["offset"] = bare["offset"]

    # a line still being written is not read; the next poll gets it whole
    with (tmp_path / "a" / "metrics.jsonl").open("a") as handle:
        handle.write('{"rollout_id": 4, "rollout/rew')
    assert client.get(f"/api/runs/a/metrics?offset={first['offset']}").json() == {"records": [], "offset": first["offset"]}
    with (tmp_path / "a" / "metrics.jsonl").open("a") as handle:
        handle.write('ard_mean": 0.5}\n')
    tail = client.get(f"/api/runs/a/metrics?offset={first['offset']}").json()
    assert tail["records"] == [{"rollout_id": 4, "rollout/reward_mean": 0.5}]

    # samples: the records write_step_samples wrote, per token
    (sample, *_rest) = client.get("/api/runs/a/samples/1").json()
    assert len(sample["tokens"]) == len(sample["token_text"]) == len(sample["rollout_log_probs"]) == len(sample["loss_mask"])
    assert "".join(sample["token_text"]) == sample["response"]
    assert client.get("/api/runs/a/samples/0").status_code == 404
    assert client.get("/api/runs/nope/metrics").status_code == 404

    # the timeline: generation is the rollout time less the reward time; "other" the rest of the step
    timeline = client.get("/api/runs/a/timeline").json()
    assert [step["rollout_id"] for step in timeline] == [0, 1, 2]
    for step, record in zip(timeline, written):
        phases = step["phases"]
        assert phases["generate"] == pytest.approx(record["perf/rollout_time_s"] - record["perf/reward_time_s"])
        assert phases["train"] == pytest.approx(record["perf/train_time_s"])
        assert phases.get("eval") == record.get("perf/eval_time_s")
        assert sum(phases.values()) == pytest.approx(record["perf/step_time_s"])
        assert set(phases) <= {*PHASE_METRICS, "other"}


def test_api_key_off_loopback(tmp_path, tokenizer):
    RunWriter(tmp_path / "a", tokenizer).write_steps(range(1))
    client = TestClient(app_for_dirs([tmp_path], api_key="s3cret"))
    assert client.get("/api/runs").status_code == 401
    assert client.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).json()[0]["id"] == "a"
    assert client.get("/").status_code == 200  # the page holds no run data
    assert client.get("/static/vendor/uPlot.iife.min.js").status_code == 200
    with pytest.raises(ValueError, match="non-loopback host '0.0.0.0' without --api-key"):
        require_key_off_loopback("0.0.0.0", None, "the dashboard", "--api-key")
    require_key_off_loopback("127.0.0.1", None, "the dashboard", "--api-key")
    with pytest.raises(ValueError, match="--miles-dashboard-api-key"):
        MilesConfig(use_miles_dashboard=True, miles_dashboard_host="0.0.0.0")
    MilesConfig(use_miles_dashboard=True, miles_dashboard_host="0.0.0.0", miles_dashboard_api_key="k")


def test_dashboard_command_errors(tmp_path, capsys):
    assert main(["dashboard", str(tmp_path / "missing"), "--port", "0"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["dashboard", str(tmp_path), "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "without --api-key" in capsys.readouterr().err


def test_vendored_uplot_is_recorded():
    from miles_host.dashboard.app import STATIC_DIR

    vendor = STATIC_DIR / "vendor"
    assert "uPlot 1.6.32" in (vendor / "VERSION").read_text() and "MIT" in (vendor / "uPlot.LICENSE").read_text()
    page = (STATIC_DIR / "index.html").read_text()  # only the package's own files, nothing from the network
    assert "http" not in page.replace("http-equiv", "")


def test_run_logger_serves_its_output_dir(tmp_path, tokenizer):
    import socket
    import urllib.request

    from miles_host.dashboard.server import DashboardLogger

    RunWriter(tmp_path / "run", tokenizer).write_steps(range(2))
    config = MilesConfig(output_dir=str(tmp_path / "run"), use_miles_dashboard=True, miles_dashboard_port=0)
    logger = DashboardLogger(config)
    try:
        with urllib.request.urlopen(logger.url + "api/runs/run/metrics") as reply:
            assert json.loads(reply.read())["records"] == read_metrics(tmp_path / "run")
    finally:
        logger.close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        busy = MilesConfig(output_dir=str(tmp_path / "run"), use_miles_dashboard=True,
                           miles_dashboard_port=taken.getsockname()[1])
        with pytest.raises(ValueError, match="give --miles-dashboard-port another port"):
            DashboardLogger(busy)
