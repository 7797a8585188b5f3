"""``OneRankTokenDispatcher``: Megatron-Core's all-gather dispatch at one rank without host
reads. Reference: Megatron's own ``MoEAllGatherTokenDispatcher`` on the same routing (the
dispatched rows, their order and probabilities, the tokens per expert, the combined output,
bit for bit), and the trainer's MoE layers use it. Skipped where megatron-core is not installed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytest.importorskip("transformers")

from tests.plugins.megatron.test_megatron_trainer import MODELS, make_trainer  # noqa: E402
from tests.plugins.megatron.conftest import save_models  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _one_rank_group(one_rank_group):
    """(see conftest: no process group left behind)"""


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    models = save_models(tmp_path_factory.mktemp("megatron_dispatcher"), {"qwen3_moe": MODELS["qwen3_moe"]})
    return make_trainer(models, "qwen3_moe", "megatron")


def _routing(num_tokens: int, num_experts: int, top_k: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    experts = scores.topk(top_k, dim=1).indices
    if num_tokens > 3:
        experts[:3] = torch.arange(top_k)  # several tokens on the same experts; others may get none
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, experts, True)
    probs = torch.zeros(num_tokens, num_experts).scatter_(1, experts, torch.rand(num_tokens, top_k, generator=generator))
    return routing_map, probs


def _dispatch_and_combine(dispatcher, hidden, routing_map, probs):
    hidden_states, probs = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    hidden_states, probs = dispatcher.token_dispatch(hidden_states, probs)
    rows, tokens_per_expert, row_probs = dispatcher.dispatch_postprocess(hidden_states, probs)
    combined = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(rows * 2.0)))
    return rows, tokens_per_expert, row_probs, combined


def test_one_rank_dispatch_is_megatrons_all_gather_dispatch(trainer):
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from miles_megatron.dispatcher import OneRankTokenDispatcher

    moe = trainer.model.gpt.decoder.layers[0].mlp
    ours = moe.token_dispatcher
    assert type(ours) is OneRankTokenDispatcher  # the trainer's layers got it
    megatrons = MoEAllGatherTokenDispatcher.__new__(MoEAllGatherTokenDispatcher)
    megatrons.__dict__.update(ours.__dict__)
    num_experts, top_k = moe.config.num_moe_experts, moe.config.moe_router_topk
    for num_tokens, seed in ((1, 0), (7, 1), (40, 2)):
        routing_map, probs = _routing(num_tokens, num_experts, top_k, seed)
        hidden = torch.randn(num_tokens, 1, moe.config.hidden_size, generator=torch.Generator().manual_seed(seed))
        got = _dispatch_and_combine(ours, hidden, routing_map, probs)
        want = _dispatch_and_combine(megatrons, hidden, routing_map, probs)
        assert got[1].device == hidden.device and want[1].device.type == "cpu"
        assert torch.equal(got[1].cpu(), want[1])
        for a, b in zip(got[:1] + got[2:], want[:1] + want[2:]):
            assert a.shape == b.shape and torch.equal(a, b)
        assert torch.allclose(got[3], 2.0 * hidden * top_k)  # (every token back from its top_k experts)


def test_where_megatrons_dispatcher_stays(trainer):
    from miles_megatron.dispatcher import applies

    dispatcher = trainer.model.gpt.decoder.layers[0].mlp.token_dispatcher
    config = dispatcher.config
    assert applies(dispatcher)
    for field, value in (("moe_expert_capacity_factor", 1.0), ("moe_permute_fusion", True),
                         ("moe_router_padding_for_quantization", True), ("moe_shared_expert_overlap", True)):
        original = getattr(config, field)
        setattr(config, field, value)
        try:
            assert not applies(dispatcher), field
        finally:
            setattr(config, field, original)
    dispatcher.ep_size = 2
    try:
        assert not applies(dispatcher)
    finally:
        dispatcher.ep_size = 1
