"""GPU: decode through captured CUDA graphs (staged inputs, incremental block tables, fused
kernels, MoE route capture) gives what the eager engine and a packed forward give."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.conftest import PROMPTS, assert_same_outputs, engine_logprobs, load
from tests.rollout.test_requests import capture_hooks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: unequal lengths finish at different steps, so batch rows shift; n=2 forks share prompt blocks
SAMPLING = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True, "n": 2} for n in (40, 7, 23, 33)]


def _engine(path, routing_hooks=None, **kwargs):
    from miles_host.rollout import Engine

    model = load(path, routing_hooks).cuda()
    return Engine(model, max_num_seqs=8, mem_fraction_static=0.3, max_kv_cache_tokens=4096, block_size=4, **kwargs)


def test_graph_decode_equals_eager_decode(qwen3_dense):
    _, path = qwen3_dense
    graphs = _engine(path)
    assert graphs.runner.graphs is not None and graphs.runner.fused_kernels
    eager = _engine(path, enforce_eager=True)
    got = graphs.generate(PROMPTS, SAMPLING)
    expected = eager.generate(PROMPTS, SAMPLING)
    assert graphs.runner.graphs.num_replays > 0
    assert_same_outputs(got, expected, atol=1e-5)


def test_moe_decode_in_graphs_returns_the_routes_of_a_packed_forward(qwen3_moe):
    from miles_host.models import ForwardContext, PackedAttention, RoutingContext

    _, path = qwen3_moe
    engine = _engine(path, capture_hooks())
    assert engine.runner.graphs is not None, "MoE decode should be captured in CUDA graphs"
    outputs = engine.generate(PROMPTS, SAMPLING, return_routed_experts=True)
    assert engine.runner.graphs.num_replays > 0
    eager = _engine(path, enforce_eager=True).generate(PROMPTS, SAMPLING)
    prompts = [p for p in PROMPTS for _ in range(2)]
    for prompt, output, plain in zip(prompts, outputs, eager):
        assert output["output_ids"] == plain["output_ids"]
        tokens = prompt + output["output_ids"]
        routing = RoutingContext(phase="rollout")
        routing.extra["capture"] = True
        context = ForwardContext(
            attention=PackedAttention(torch.tensor([0, len(tokens) - 1], dtype=torch.int32, device="cuda")),
            routing=routing,
        )
        with torch.no_grad():
            engine.model.forward_hidden(
                torch.tensor(tokens[:-1], device="cuda"), torch.arange(len(tokens) - 1, device="cuda"), context
            )
        reference = torch.stack([routing.captured[i] for i in sorted(routing.captured)], dim=1).cpu()
        routes = torch.as_tensor(output["meta_info"]["routed_experts"]).long()
        assert routes.shape == reference.shape
        assert torch.equal(routes.sort(-1).values, reference.sort(-1).values)


def test_overlapped_graph_decode_equals_plain_graph_decode(qwen3_dense):
    """Overlap on the GPU: steps launched before the previous one is read (asynchronous pinned
    read-back) give the plain engine's tokens and logprobs, seeded sampling and stops included."""
    _, path = qwen3_dense
    params = [
        {"temperature": 0, "max_new_tokens": 17},
        {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 25, "sampling_seed": 3, "n": 2},
        {"temperature": 0.8, "max_new_tokens": 9, "sampling_seed": 11, "stop_token_ids": [5, 17, 33, 60]},
        {"temperature": 1.0, "max_new_tokens": 30, "ignore_eos": True, "sampling_seed": 7},
    ]
    plain = _engine(path, overlap_schedule=False).generate(PROMPTS, params)
    overlapped_engine = _engine(path, overlap_schedule=True)
    overlapped = overlapped_engine.generate(PROMPTS, params)
    assert overlapped_engine.runner.graphs.num_replays > 0
    for a, b in zip(overlapped, plain):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
        assert (engine_logprobs(a) - engine_logprobs(b)).abs().max() <= 1e-5
