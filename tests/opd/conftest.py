"""A tiny student and tiny teachers (hidden 64, 2 layers, the student's character
tokenizer), and the addition prompts of the loop tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.loop.conftest import build_tiny_policy, write_addition_data


def build_teacher(directory: Path, student: Path, seed: int, sharpness: float) -> Path:
    """A Qwen3 model of the student's shape and tokenizer, other random weights; the final
    norm's weight times ``sharpness`` makes its next-token distributions peaked."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(student)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.mul_(sharpness)
    model.save_pretrained(directory)
    transformers.AutoTokenizer.from_pretrained(student).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def opd_task(tmp_path_factory):
    """(student dir, teacher dir, prompts file)."""
    root = tmp_path_factory.mktemp("opd_task")
    student = build_tiny_policy(root / "student")
    teacher = build_teacher(root / "teacher", student, seed=11, sharpness=8.0)
    data = write_addition_data(root / "data.jsonl", 64)
    return student, teacher, data
