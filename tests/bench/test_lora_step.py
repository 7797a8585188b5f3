"""``bench/lora_step.py --tiny``: the LoRA variant of miles' GRPO step runs and reports
its timing and parameter counts (on the CPU; the GPU figures come from the H200)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


def test_tiny_lora_variant_reports_its_step(tmp_path):
    from bench import lora_step

    result = lora_step.main(["--tiny", "--only", "lora", "--workdir", str(tmp_path)])["lora"]
    assert result["step_s"] > 0 and result["train_s"] > 0
    assert 0 < result["trainable_params"] < result["total_params"]
    assert result["grad_gb"] <= result["param_gb"]  # gradients for the adapters only
