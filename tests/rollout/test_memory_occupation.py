"""Engine.release_memory_occupation / resume_memory_occupation (``--colocate``, ``--offload-rollout``):
results after a resume equal a never-released engine's, requests are refused while
released, weight updates while released are kept, ``weights`` moves the weights off."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.rollout.conftest import PROMPTS, make_engine

#: greedy, and seeded sampling with n > 1 (a prompt's samples share its prefix blocks)
SAMPLING = [
    {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
    {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 11, "n": 3},
    {"temperature": 0.7, "top_k": 20, "max_new_tokens": 9, "ignore_eos": True, "sampling_seed": 5, "n": 2},
    {"temperature": 0, "max_new_tokens": 7, "ignore_eos": True, "n": 2},
]
BOTH = ["kv_cache", "weights"]


def _tokens_and_logprobs(outputs):
    return [(o["output_ids"], [e[0] for e in o["meta_info"]["output_token_logprobs"]]) for o in outputs]


def _perturbed(engine, scale: float = 0.05) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        name: tensor + scale * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
        for name, tensor in engine.model.state_dict().items()
    }


@pytest.mark.parametrize("tags", [["kv_cache"], BOTH])
def test_results_after_resume_equal_a_never_released_engine(qwen3_dense, tags):
    _, path = qwen3_dense
    engine, reference = make_engine(path), make_engine(path)
    expected = _tokens_and_logprobs(reference.generate(PROMPTS, SAMPLING))
    first = _tokens_and_logprobs(engine.generate(PROMPTS, SAMPLING))  # also leaves prefixes cached
    blocks = engine.kv_cache.num_blocks
    shapes = [tuple(t.shape) for t in engine.kv_cache.k_NSHD + engine.kv_cache.v_NSHD]
    for _ in range(2):
        engine.release_memory_occupation(tags)
        assert engine.released_tags == frozenset(tags)
        assert engine.kv_cache.k_NSHD == [] and engine.kv_cache.v_NSHD == [] and engine.kv_cache.num_bytes == 0
        engine.resume_memory_occupation()
        assert engine.released_tags == frozenset()
        assert engine.kv_cache.num_blocks == blocks
        assert [tuple(t.shape) for t in engine.kv_cache.k_NSHD + engine.kv_cache.v_NSHD] == shapes
        assert _tokens_and_logprobs(engine.generate(PROMPTS, SAMPLING)) == expected
    assert first == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_generating_while_released_is_refused_with_a_clear_error(qwen3_dense):
    _, path = qwen3_dense
    engine = make_engine(path)
    engine.release_memory_occupation(["kv_cache"])
    with pytest.raises(RuntimeError, match=r"memory is released \(kv_cache\).*resume_memory_occupation"):
        engine.generate(PROMPTS, SAMPLING)
    with pytest.raises(RuntimeError, match="resume_memory_occupation"):
        engine.add_request("a", PROMPTS[0], SAMPLING[0])
    with pytest.raises(RuntimeError, match="resume_memory_occupation"):
        asyncio.run(engine.async_generate(PROMPTS[0], SAMPLING[0]))
    assert not engine.has_unfinished()
    engine.release_memory_occupation(["weights"])
    engine.resume_memory_occupation(["weights"])  # the KV cache is still released
    with pytest.raises(RuntimeError, match=r"memory is released \(kv_cache\)"):
        engine.generate(PROMPTS[:1], SAMPLING[:1])
    engine.resume_memory_occupation(["kv_cache"])
    assert len(engine.generate(PROMPTS[:1], SAMPLING[:1])) == 1


def test_release_needs_an_idle_engine_and_known_tags(qwen3_dense):
    _, path = qwen3_dense
    engine = make_engine(path)
    with pytest.raises(ValueError, match="unknown memory tags"):
        engine.release_memory_occupation(["kv"])
    engine.add_request("a", PROMPTS[0], SAMPLING[0])
    engine.step()
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.release_memory_occupation()
    assert engine.released_tags == frozenset()
    engine.abort()
    engine.step()
    engine.release_memory_occupation()
    engine.release_memory_occupation()  # already released: nothing to do
    assert engine.released_tags == frozenset(BOTH)


@pytest.mark.parametrize("tags", [["kv_cache"], BOTH])
def test_a_weight_update_while_released_is_seen_after_resume(qwen3_dense, tags):
    _, path = qwen3_dense
    engine, reference = make_engine(path), make_engine(path)
    new_weights = _perturbed(reference)
    reference.update_weights(new_weights, weight_version=1)
    expected = _tokens_and_logprobs(reference.generate(PROMPTS, SAMPLING))
    before = _tokens_and_logprobs(engine.generate(PROMPTS, SAMPLING))
    assert before != expected  # the update matters
    engine.release_memory_occupation(tags)
    assert engine.update_weights(list(new_weights.items()), weight_version=1) == 1
    engine.resume_memory_occupation()
    outputs = engine.generate(PROMPTS, SAMPLING)
    assert _tokens_and_logprobs(outputs) == expected
    assert {o["meta_info"]["weight_version"] for o in outputs} == {1}


def test_offload_rollout_moves_the_weights_off_and_back(qwen3_dense):
    _, path = qwen3_dense
    engine = make_engine(path)
    values = {name: t.clone() for name, t in engine.model.state_dict().items()}
    parameters = dict(engine.model.named_parameters())
    storage = {name: p.data_ptr() for name, p in parameters.items()}

    engine.release_memory_occupation(["kv_cache"])  # the KV cache alone keeps the weights where they are
    assert all(p.data_ptr() == storage[name] for name, p in parameters.items())
    engine.resume_memory_occupation()

    engine.release_memory_occupation(BOTH)
    offloaded = {name: p.data_ptr() for name, p in engine.model.named_parameters()}
    for name, p in engine.model.named_parameters():
        assert p is parameters[name]  # the same Parameter objects, re-pointed
        assert p.device.type == "cpu" and p.data_ptr() != storage[name], name
        assert torch.equal(p, values[name])
    engine.resume_memory_occupation()
    for name, p in engine.model.named_parameters():
        assert p.device == torch.device(engine.device) and p.data_ptr() != offloaded[name], name
    for name, t in engine.model.state_dict().items():
        assert torch.equal(t, values[name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_release_hands_the_gpu_memory_back_and_resume_recaptures_the_graphs(qwen3_dense):
    from tests.rollout.conftest import load

    from miles_host.rollout import Engine

    _, path = qwen3_dense
    engine = Engine(load(path).cuda(), max_num_seqs=8, mem_fraction_static=0.3, max_kv_cache_tokens=4096, block_size=4)
    assert engine.runner.graphs is not None
    expected = _tokens_and_logprobs(engine.generate(PROMPTS, SAMPLING))
    kv_bytes, resident = engine.kv_cache.num_bytes, torch.cuda.memory_reserved(engine.device)
    engine.release_memory_occupation(BOTH)
    assert engine.runner.graphs is None
    assert torch.cuda.memory_reserved(engine.device) <= resident - kv_bytes
    engine.resume_memory_occupation()
    assert engine.runner.graphs is not None and engine.kv_cache.num_bytes == kv_bytes
    assert _tokens_and_logprobs(engine.generate(PROMPTS, SAMPLING)) == expected
    assert engine.runner.graphs.num_replays > 0
