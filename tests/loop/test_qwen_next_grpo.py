"""A GRPO step on a tiny Qwen3-Next (Gated DeltaNet + gated attention, MoE with a gated shared
expert) through the real loop, with R3: training uses the rollout's experts on every token-layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.loop.conftest import write_addition_data
from tests.models.qwen_next_cases import save_case
from tests.plugins.r3.test_r3 import _char_tokenizer, _run

pytest.importorskip("transformers")


def test_grpo_step_with_routing_replay(tmp_path):
    model = save_case("qwen3_next", tmp_path / "model", vocab_size=14, eos_token_id=1, pad_token_id=0, bos_token_id=0)
    _char_tokenizer().save_pretrained(model)
    data = write_addition_data(tmp_path / "data.jsonl", 8)
    run, samples, metrics, observer = _run(model, data, tmp_path / "run", "--plugins", "r3")
    moe_layers = [i for i, moe in enumerate(run.trainer.model.config.moe_layers) if moe]
    assert moe_layers == [0, 1]  # layer 2 is dense (mlp_only_layers)
    train_passes = [ids for phase, _, ids in observer.used if phase == "train"]
    assert len(train_passes) == len(samples) * len(moe_layers)
    for index, sample in enumerate(samples):
        assert sample.rollout_routed_experts.shape == (len(sample.tokens) - 1, len(moe_layers), 2)
        for position in range(len(moe_layers)):
            used = train_passes[index * len(moe_layers) + position][:-1].sort(dim=-1).values
            rollout = torch.from_numpy(sample.rollout_routed_experts[:, position].astype(np.int64)).sort(dim=-1).values
            assert torch.equal(used, rollout)
    assert np.isfinite(metrics["train/train_rollout_logprob_abs_diff"])
    # the step trained the linear-attention layer and the router (gradients reached them)
    linear = run.trainer.model.layers[0].attn
    for parameter in (linear.in_proj.weight, linear.A_log, run.trainer.model.layers[0].mlp.router.weight):
        assert parameter.grad is not None and float(parameter.grad.abs().sum()) > 0
