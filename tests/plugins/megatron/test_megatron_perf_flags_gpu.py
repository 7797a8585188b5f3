"""slime's MoE PERF_ARGS on the megatron backend, on a GPU: ``--moe-token-dispatcher-type
alltoall`` (and ``flex``, run as alltoall) and ``--moe-router-dtype fp32`` reach the
Megatron-Core ``TransformerConfig`` the trainer builds, and the dispatcher changes where
tokens travel, not what they compute: the log-probs equal the allgather dispatcher's
within bf16 rounding."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.plugins.megatron.test_megatron_gpu import (  # noqa: E402
    TOL_MAX,
    TOL_MEAN,
    build_moe_model,
    log_probs,
    make_samples,
    make_trainer,
    write_prompts,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module", autouse=True)
def _one_rank_group(one_rank_group):
    """(see conftest: no process group left behind)"""


def test_moe_perf_flags_reach_megatron_and_keep_the_log_probs(tmp_path):
    model = build_moe_model(tmp_path / "model")
    data = write_prompts(tmp_path / "prompts.jsonl", 8)
    samples = make_samples()
    allgather = make_trainer(model, data, "megatron", "--moe-router-dtype", "fp32")
    alltoall = make_trainer(model, data, "megatron", "--moe-router-dtype", "fp32",
                            "--moe-token-dispatcher-type", "alltoall", "--attention-softmax-in-fp32")
    flex = make_trainer(model, data, "megatron", "--moe-token-dispatcher-type", "flex")
    assert alltoall.model.gpt.config.moe_token_dispatcher_type == "alltoall"
    assert alltoall.model.gpt.config.moe_router_dtype == "fp32"
    assert alltoall.model.gpt.config.attention_softmax_in_fp32
    assert flex.model.gpt.config.moe_token_dispatcher_type == "alltoall"  # no DeepEP here
    want, got = log_probs(allgather, samples), log_probs(alltoall, samples)
    diff = (got - want).abs()
    print(f"\nalltoall vs allgather dispatcher: max {float(diff.max()):.3g}, mean {float(diff.mean()):.3g}")
    assert float(diff.mean()) < TOL_MEAN and float(diff.max()) < TOL_MAX
