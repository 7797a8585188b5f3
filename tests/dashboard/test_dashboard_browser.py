"""The dashboard page in a real headless Chromium (Debian's ``/usr/bin/chromium``, driven by
playwright's Python package; playwright's own browser downloads are not used).

A finished run and a live one are served by ``miles dashboard``'s server; the test reads the
points every uPlot chart holds back from the page (``window.milesDashboard``) and compares them
with metrics.jsonl as written, appends steps to the live run while the page is open and waits for
them to be drawn, and opens a sample in the rollout browser (its tokens, the heat map of
|train - rollout| log-prob, the loss mask, the expert agreement bars). Screenshots are written
under the test's tmp directory (``screenshots/``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_host.dashboard.server import serve_dashboard
from tests.dashboard.conftest import RunWriter, read_metrics

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="/usr/bin/chromium is not installed (scripts/setup.sh "
                                                              "installs Debian's chromium when run as root)")


def expected_curves(records_by_run: dict[str, list[dict]]) -> dict[str, dict[str, list[tuple]]]:
    """metric -> run -> [(rollout_id, value)] of every number in metrics.jsonl (strings such as "nan" are not points)."""
    curves: dict[str, dict[str, list[tuple]]] = {}
    for run, records in records_by_run.items():
        for record in records:
            for key, value in record.items():
                if key != "rollout_id" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    curves.setdefault(key, {}).setdefault(run, []).append((record["rollout_id"], value))
    return curves


def plotted_curves(page) -> dict[str, dict[str, list[tuple]]]:
    """metric -> run -> [(x, y)] of the non-null points each uPlot chart on the page holds."""
    charts = page.evaluate("""() => Object.fromEntries(Object.entries(window.milesDashboard.charts)
        .map(([metric, chart]) => [metric, {runs: chart.runIds, data: chart.plot.data}]))""")
    curves: dict[str, dict[str, list[tuple]]] = {}
    for metric, chart in charts.items():
        xs = chart["data"][0]
        for run, ys in zip(chart["runs"], chart["data"][1:]):
            points = [(x, y) for x, y in zip(xs, ys) if y is not None]
            if points:
                curves.setdefault(metric, {})[run] = points
    return curves


def heat_rgb(fraction: float) -> str:
    other = round(255 * (1 - max(0.0, min(1.0, fraction))))
    return f"rgb(255, {other}, {other})"


def test_dashboard_page_in_chromium(tmp_path, tokenizer):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    shots = tmp_path / "screenshots"
    shots.mkdir()
    finished = RunWriter(tmp_path / "runs" / "finished", tokenizer, sample_steps=(4, 5))
    finished.write_steps(range(6))
    live = RunWriter(tmp_path / "runs" / "live", tokenizer, seed=1)
    live.write_steps(range(2))
    server = serve_dashboard([tmp_path / "runs"], port=0)
    try:
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(server.url + "/?poll=250")

            # the finished run and the live one, every metric of both drawn as in metrics.jsonl
            def wait_for_steps(finished_steps: int, live_steps: int) -> None:
                page.wait_for_function(
                    """([a, b]) => { const s = window.milesDashboard;
                        return s.records.finished && s.records.finished.length === a && s.records.live
                               && s.records.live.length === b && s.charts["rollout/reward_mean"]
                               && s.charts["rollout/reward_mean"].plot.data[0].length === Math.max(a, b); }""",
                    arg=[finished_steps, live_steps], timeout=20_000)

            wait_for_steps(6, 2)
            runs = {"finished": read_metrics(finished.path), "live": read_metrics(live.path)}
            assert plotted_curves(page) == expected_curves(runs)
            assert "eval/gsm8k/accuracy" in expected_curves(runs) and "train/grad_norm" not in expected_curves(runs)
            page.screenshot(path=str(shots / "metrics.png"), full_page=True)

            # live: steps appended while the page is open are drawn
            live.write_steps(range(2, 5))
            wait_for_steps(6, 5)
            runs["live"] = read_metrics(live.path)
            assert plotted_curves(page) == expected_curves(runs)
            page.screenshot(path=str(shots / "metrics_live.png"), full_page=True)

            # the rollout browser: the last step's first sample, token by token
            page.click("nav button[data-view=rollouts]")
            page.select_option("#sample-run", "finished")
            page.wait_for_selector("#sample-detail .tok")
            sample = finished_samples(finished.path, 5)[0]
            texts = page.locator("#sample-detail .tok .text").all_text_contents()
            assert texts == sample["token_text"] and "".join(texts) == sample["response"]
            diffs = [abs(t - r) for t, r in zip(sample["train_log_probs"], sample["rollout_log_probs"])]
            colours = page.eval_on_selector_all("#sample-detail .tok .text", "els => els.map(e => e.style.background)")
            assert colours == [heat_rgb(d / max(diffs)) for d in diffs]
            masked = page.eval_on_selector_all("#sample-detail .tok", "els => els.map(e => e.classList.contains('masked'))")
            assert masked == [m == 0 for m in sample["loss_mask"]]
            bars = page.eval_on_selector_all("#sample-detail .tok .agree", "els => els.map(e => e.style.background)")
            assert len(bars) == len(sample["tokens"])
            assert page.locator("#sample-table tbody tr").count() == len(finished_samples(finished.path, 5))
            page.screenshot(path=str(shots / "rollouts.png"), full_page=True)

            # the timeline: one bar per step, its phases in proportion to their seconds
            page.click("nav button[data-view=timeline]")
            page.select_option("#timeline-run", "finished")
            page.wait_for_function("() => document.querySelectorAll('#timeline .timeline-row').length === 6")
            page.screenshot(path=str(shots / "timeline.png"), full_page=True)
            assert errors == []

            # with an API key the page sends the one it was opened with (/?key=...)
            keyed = serve_dashboard([tmp_path / "runs"], port=0, api_key="s3cret")
            try:
                page.goto(keyed.url + "/?poll=250")
                page.wait_for_function("() => document.getElementById('status').textContent.includes('401')")
                page.goto(keyed.url + "/?key=s3cret&poll=250")
                page.wait_for_function("() => (window.milesDashboard.records.live || []).length === 5")
            finally:
                keyed.stop()
            browser.close()
    finally:
        server.stop()
    assert all((shots / name).stat().st_size > 0 for name in ("metrics.png", "metrics_live.png", "rollouts.png", "timeline.png"))


def finished_samples(run: Path, step: int) -> list[dict]:
    import json

    from miles_host.dashboard.samples import step_file

    return [json.loads(line) for line in step_file(run, step).read_text().splitlines()]
