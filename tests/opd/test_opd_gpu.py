"""OPD on a CUDA GPU: the embedded teacher in bf16 (``--dtype auto``) against transformers'
float64 log-probs, and a short OPD run whose reverse KL falls."""

from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest
import torch

from miles_host.config import MilesConfig
from miles_host.opd.embedded import EmbeddedTeacher
from tests.loop.conftest import read_metrics
from tests.opd.test_opd_run import first_and_last, opd_args
from tests.opd.test_teachers import reference_log_probs, samples_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_embedded_teacher_in_bf16_on_cuda_matches_transformers(opd_task):
    student, teacher, _ = opd_task
    config = MilesConfig(hf_checkpoint=str(student), use_opd=True, opd_type="embedded", opd_teacher_load=str(teacher),
                         device="cuda")
    scorer = EmbeddedTeacher(config)
    assert next(scorer.model.parameters()).dtype == torch.bfloat16
    for row, want in zip(scorer.log_probs(samples_of()), reference_log_probs(teacher)):
        np.testing.assert_allclose(row, want, rtol=0.02, atol=0.05)  # bf16 weights and activations


def test_opd_run_on_cuda_pulls_the_student_toward_the_teacher(opd_task, tmp_path):
    """In a process of its own, with this one's cached blocks returned first; the memory the GPU
    tests before it still hold counts as used in the engine's KV sizing
    (``--sglang-mem-fraction-static`` is of the whole GPU), so the fraction leaves 10% beyond it."""
    student, teacher, data = opd_task
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    fraction = min(0.9, (total - free) / total + 0.1)
    argv = opd_args(student, teacher, data, tmp_path / "opd", "--num-rollout", "16", "--device", "cuda",
                    "--sglang-mem-fraction-static", f"{fraction:.3f}")
    assert subprocess.run([sys.executable, "-m", "miles_host.cli.main", *argv]).returncode == 0
    start, end = first_and_last([m["opd/kl"] for m in read_metrics(tmp_path / "opd")])
    assert end < 0.5 * start, (start, end)
