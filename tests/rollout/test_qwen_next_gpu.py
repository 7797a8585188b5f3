"""GPU: a hybrid model (Gated DeltaNet + gated attention) decodes through CUDA graphs that gather and
scatter each row's recurrent state, giving the eager engine's tokens and log-probs (and transformers'
greedy tokens), including rows that shift as sequences finish, forked samples and a pool that grows."""

from __future__ import annotations

import pytest
import torch

from tests.models.qwen_next_cases import hf_model, save_case
from tests.rollout.conftest import PROMPTS, assert_same_outputs, load

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: unequal lengths finish at different steps, so batch rows shift; n=2 forks share the prefill
SAMPLING = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True, "n": 2} for n in (40, 7, 23, 33)]


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return str(save_case("qwen3_next", tmp_path_factory.mktemp("qwen3_next_gpu"), peaky=True))


def _engine(path, **kwargs):
    from miles_host.rollout import Engine

    return Engine(load(path).cuda(), max_num_seqs=8, mem_fraction_static=0.3, max_kv_cache_tokens=4096,
                  block_size=4, **kwargs)


def test_graph_decode_equals_eager_decode_and_transformers(qwen3_next):
    graphs = _engine(qwen3_next)
    assert graphs.runner.graphs is not None, "hybrid decode should be captured in CUDA graphs"
    eager = _engine(qwen3_next, enforce_eager=True)
    got = graphs.generate(PROMPTS, SAMPLING)
    expected = eager.generate(PROMPTS, SAMPLING)
    assert graphs.runner.graphs.num_replays > 0
    assert_same_outputs(got, expected, atol=1e-4)
    # on the GPU: with fla importable, transformers' Qwen3-Next runs fla's Triton kernels, CUDA only
    hf = hf_model(qwen3_next).cuda()
    for prompt, output in zip(PROMPTS, got[::2]):
        tokens = list(prompt)
        with torch.no_grad():
            for _ in output["output_ids"]:
                tokens.append(int(hf(torch.tensor([tokens], device="cuda")).logits[0, -1].argmax()))
        assert output["output_ids"] == tokens[len(prompt):]


def test_graphs_follow_the_pool_when_it_grows(qwen3_next):
    engine = _engine(qwen3_next)
    pool = engine.recurrent_states
    reference = engine.generate(PROMPTS[:1], {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})[0]
    slots = pool.num_slots
    # the pool holds max_num_seqs + 2 slots, so the scheduler never needs more; it grows when
    # sequences hold more (forks of a request beyond the running limit): grown here directly,
    # the decode graphs must be captured again over the new state tensors
    pool._grow()
    assert pool.num_slots == 2 * slots
    outputs = engine.generate(PROMPTS[:1], {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True, "n": 3})
    assert all(o["output_ids"] == reference["output_ids"] for o in outputs)
