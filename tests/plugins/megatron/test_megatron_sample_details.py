"""``--dump-details`` with megatron trainer groups: the driver's train-data dump has every sample's
training log-probs (PP: the last stage computes them; TP: both ranks do, one is kept)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytest.importorskip("transformers")

from tests.distributed.test_sample_details import assert_dump_has_initial_model_log_probs  # noqa: E402
from tests.plugins.megatron.test_megatron_parallel import clean_groups  # noqa: E402,F401


@pytest.mark.slow
@pytest.mark.parametrize("flag", [
    pytest.param("--pipeline-model-parallel-size", id="pp2"),
    pytest.param("--tensor-model-parallel-size", id="tp2"),
])
def test_megatron_model_parallel_run_dumps_every_samples_log_probs(tmp_path, clean_groups, flag):
    """Two megatron trainer processes (gloo): step 0's train data holds, for every sample, the initial
    model's log-probs of its response, as transformers computes them in float64."""
    from miles_host.cli.main import main
    from miles_host.quickstart_preset import QUICKSTART_DIR

    dump = tmp_path / "dump"
    assert main(["run", "--train-backend", "megatron", flag, "2", "--actor-num-gpus-per-node", "2",
                 "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--num-rollout", "1", "--no-progress",
                 "--worker-timeout", "120", "--output-dir", str(tmp_path / "out"), "--dump-details", str(dump)]) == 0
    assert_dump_has_initial_model_log_probs(dump, QUICKSTART_DIR / "model")
