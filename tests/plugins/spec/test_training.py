"""Online MTP training raises acceptance; abort mid-speculation; `miles run` with slime's speculative flags."""

from __future__ import annotations

import json
import types
from pathlib import Path

import torch

from miles_host.cli.main import main
from miles_host.sample import Sample
from miles_host.trainer import PackedBatch
from miles_spec.draft import attach_mtp
from miles_spec.training import mtp_loss
from tests.loop.conftest import base_args, read_metrics
from tests.plugins.spec.conftest import load, spec_engine

PROMPTS = [[5, 9, 17, 33, 2], [7, 7, 7, 3], [40, 41, 42], [100, 3, 60, 61]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


def _accept_rate(engine) -> float:
    engine.generate(PROMPTS, GREEDY)
    counters = engine.strategy.pop_counters()
    return counters.accepted_tokens / counters.draft_tokens


def test_online_mtp_training_raises_acceptance(policy):
    """The draft learns the policy's own continuations (from its hidden states) and gets accepted."""
    _, path = policy
    engine = spec_engine(path, num_steps=3)
    outputs = engine.generate(PROMPTS, GREEDY)
    samples = [Sample(prompt="", tokens=p + o["output_ids"], response_length=len(o["output_ids"]),
                      loss_mask=[1] * len(o["output_ids"])) for p, o in zip(PROMPTS, outputs)]
    engine.strategy.pop_counters()
    trainer_model = load(path)
    torch.manual_seed(1)
    attach_mtp(trainer_model)
    trainer_model.load_state_dict({k: v for k, v in engine.model.state_dict().items()})  # same draft start
    optimizer = torch.optim.AdamW(trainer_model.mtp.parameters(), lr=3e-3)
    config = types.SimpleNamespace(mtp_loss_scaling_factor=1.0)
    batch = PackedBatch.from_samples(samples, torch.device("cpu"))
    batch.model_config = trainer_model.config
    rates = [_accept_rate(engine)]
    for _round in range(1):
        for _ in range(50):
            with torch.no_grad():
                from miles_host.models import PackedAttention
                from miles_host.models.context import ForwardContext

                hidden = trainer_model.forward_hidden(
                    batch.input_ids_T, batch.positions_T, ForwardContext(attention=PackedAttention(batch.cu_seqlens))
                )
            loss, metrics = mtp_loss({"batch": batch, "model": trainer_model, "hidden": hidden}, None, config)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        engine.update_weights([(k, v) for k, v in trainer_model.state_dict().items() if k.startswith("mtp.")])
        rates.append(_accept_rate(engine))
    print(f"greedy acceptance rate over online MTP training: {rates}")
    assert rates[-1] > rates[0] + 0.3
    # the policy's outputs are unchanged by speculation and draft training
    assert [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)] == [o["output_ids"] for o in outputs]


def test_abort_mid_speculation(policy, bad_draft):
    _, path = policy
    engine = spec_engine(path, draft_path=bad_draft[1], num_steps=3)
    params = {"temperature": 1.0, "max_new_tokens": 40, "ignore_eos": True, "n": 2, "sampling_seed": 1}
    engine.add_request("a", PROMPTS[0], params)
    engine.add_request("b", PROMPTS[1], params)
    for _ in range(4):
        engine.step()
    aborted = engine.abort("a")
    assert len(aborted) == 2
    for output in aborted:
        assert output["meta_info"]["finish_reason"] == {"type": "abort", "message": "aborted"}
        assert 0 < len(output["output_ids"]) < 40
        assert len(output["meta_info"]["output_token_logprobs"]) == len(output["output_ids"])
        assert output["meta_info"]["spec_verify_ct"] >= 1
    finished = []
    while engine.has_unfinished():
        finished.extend(engine.step())
    assert sorted(o["meta_info"]["id"] for o in finished) == ["b", "b"]
    assert all(len(o["output_ids"]) == 40 for o in finished)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_miles_run_with_the_seed_flags(tiny_task, tmp_path):
    """slime's speculative flags (--sglang-speculative-*), and an FR-Spec token map (the first half of the vocabulary)."""
    model, data = tiny_task
    out = tmp_path / "out"
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    token_map = tmp_path / "hot_token_id.json"
    token_map.write_text(json.dumps(list(range(vocab // 2))))
    code = main(base_args(
        model, data, out, "--num-rollout", "2",
        "--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "3",
        "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "4",
        "--mtp-num-layers", "1", "--enable-mtp-training", "--sglang-speculative-token-map", str(token_map),
    ))
    assert code == 0
    metrics = read_metrics(out)
    assert len(metrics) == 2
    for step in metrics:
        assert 0.0 <= step["spec/accept_rate"] <= 1.0
        assert step["spec/accept_len_mean"] >= 1.0
        assert step["train/mtp/loss"] > 0


def test_fresh_draft_of_an_moe_policy_is_initialised(moe_policy):
    """Router and experts of a freshly attached MoE draft layer get nn.Linear's init (they are
    allocated with torch.empty, which can hold NaN), so the first MTP loss is finite."""
    _, path = moe_policy
    model = load(path)
    torch.manual_seed(0)
    attach_mtp(model)
    layer = model.mtp[0]
    hidden = model.config.hidden_size
    for name, parameter in layer.named_parameters():
        assert torch.isfinite(parameter).all(), name
    experts = layer.mlp.experts
    assert experts.gate_up_proj.abs().max() <= hidden ** -0.5 and experts.gate_up_proj.std() > 0
    assert experts.down_proj.abs().max() <= experts.down_proj.shape[-1] ** -0.5
    assert layer.mlp.router.weight.abs().max() <= hidden ** -0.5 and layer.mlp.router.weight.std() > 0
