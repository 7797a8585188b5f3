"""OPD on the quickstart: the GRPO-trained quickstart policy as teacher, the shipped one as
student, no training reward (every reward 0): opd/kl falls and eval accuracy rises."""

from __future__ import annotations

import json
import textwrap

import pytest

from miles_host.cli.main import main
from miles_host.quickstart import EVAL_PATH, MODEL_DIR, TRAIN_PATH
from miles_host.quickstart_preset import quickstart_defaults
from tests.loop.conftest import read_metrics


def quickstart_flags_without_reward() -> list[str]:
    """The quickstart preset as flags, less its reward and evaluation."""
    flags = []
    for name, value in quickstart_defaults().items():
        if name in ("rm_type", "eval_prompt_data"):
            continue
        option = "--" + name.replace("_", "-")
        if value is True:
            flags.append(option)
        elif value is not False:
            flags += [option, *(map(str, value) if isinstance(value, list) else [str(value)])]
    return flags


@pytest.mark.slow
def test_opd_from_the_grpo_trained_quickstart_teacher(tmp_path, monkeypatch):
    teacher = tmp_path / "teacher"
    assert main(["run", "--output-dir", str(tmp_path / "grpo"), "--save-hf", str(teacher)]) == 0
    teacher_accuracy = [m["eval/addition/accuracy"] for m in read_metrics(tmp_path / "grpo")
                        if "eval/addition/accuracy" in m]
    assert teacher_accuracy[-1] >= 0.8

    (tmp_path / "opd_eval_reward.py").write_text(textwrap.dedent("""
        def exact(sample, config=None):
            return float(sample.response.strip() == str(sample.label).strip())
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    eval_config = tmp_path / "eval.yaml"
    eval_config.write_text(json.dumps({"eval": {"datasets": [
        {"name": "addition", "path": str(EVAL_PATH), "custom_rm_path": "opd_eval_reward.exact"}]}}))
    flags = quickstart_flags_without_reward()
    assert str(MODEL_DIR) in flags and str(TRAIN_PATH) in flags
    assert main(["run", *flags, "--eval-config", str(eval_config), "--output-dir", str(tmp_path / "opd"),
                 "--no-progress", "--use-opd", "--opd-type", "embedded", "--opd-teacher-load", str(teacher)]) == 0
    metrics = read_metrics(tmp_path / "opd")
    accuracy = [m["eval/addition/accuracy"] for m in metrics if "eval/addition/accuracy" in m]
    kl = [m["opd/kl"] for m in metrics if "opd/kl" in m]
    print(f"\nOPD quickstart eval accuracy: {accuracy}\nopd/kl: {[round(k, 3) for k in kl]}")
    assert all(m["rollout/reward_mean"] == 0.0 for m in metrics if "rollout/reward_mean" in m)
    assert accuracy[0] <= 0.4 and max(accuracy) >= 0.9 and accuracy[-1] >= 0.8
    assert sum(kl[-5:]) / 5 < 0.25 * sum(kl[:5]) / 5
