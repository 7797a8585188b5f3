"""``bench/quickstart_gpu.py --tiny``: base policy, then bf16 / FP8 / INT4 runs of the quickstart, on the CPU."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")


def test_tiny_quickstart_bench_runs_every_precision(tmp_path, capsys):
    from bench import quickstart_gpu

    report = quickstart_gpu.main(["--tiny", "--workdir", str(tmp_path)])
    assert set(report["results"]) == {"bf16", "fp8", "int4"}
    for name, result in report["results"].items():
        assert sorted(result["curve"]) == [0, 1, 2], name  # evals before the first and after each rollout
        assert all(0.0 <= accuracy <= 1.0 for accuracy in result["curve"].values())
        assert json.loads((tmp_path / name / "config.json").read_text())["precision"] == name
    config = (tmp_path / "quickstart.yaml").read_text()
    assert "hidden" not in config and str(tmp_path / "base" / "model") in config
    out = capsys.readouterr().out
    assert "| rollouts | bf16 | fp8 | int4 |" in out and "run wall time (s)" in out
