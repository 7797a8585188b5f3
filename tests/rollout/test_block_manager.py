"""Paged KV blocks: prefix cache, reference counts, copy-on-write, n-sample sharing."""

from __future__ import annotations

from miles_host.rollout.block_manager import BlockManager
from miles_host.rollout.sampling_params import SamplingParams
from miles_host.rollout.sequence import Sequence
from tests.rollout.conftest import engine_logprobs, hf_logprobs, make_engine


def seq(tokens, rid="r"):
    return Sequence(rid=rid, token_ids=list(tokens), num_prompt_tokens=len(tokens), params=SamplingParams())


def test_prefix_cache_reuses_full_blocks_but_never_the_last_token():
    manager = BlockManager(num_blocks=16, block_size=4)
    first = seq(range(10))
    manager.allocate(first)
    assert len(first.block_table) == 3 and first.num_cached_tokens == 0
    manager.register_full_blocks(first, 10)
    second = seq(list(range(8)) + [99, 98, 97])
    manager.allocate(second)
    assert second.block_table[:2] == first.block_table[:2]
    assert second.num_cached_tokens == 8
    assert [manager.ref_counts[b] for b in first.block_table] == [2, 2, 1]
    exact = seq(range(8))  # both blocks cached, but the last token must be recomputed
    manager.allocate(exact)
    assert exact.num_cached_tokens == 4
    manager.free(first)
    manager.free(second)
    manager.free(exact)
    assert manager.num_free_blocks == 15
    # freed blocks keep their content: a new identical prefix still hits
    again = seq(range(9))
    manager.allocate(again)
    assert again.num_cached_tokens == 8


def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    manager = BlockManager(num_blocks=16, block_size=4)
    parent = seq(range(6))
    manager.allocate(parent)
    child = seq(range(6))
    manager.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [manager.ref_counts[b] for b in parent.block_table] == [2, 2]
    child.token_ids.append(50)  # the child's first token lands in the shared partial block
    manager.prepare_append(child)
    assert child.block_table[0] == parent.block_table[0]
    assert child.block_table[1] != parent.block_table[1]
    assert manager.pending_copies == [(parent.block_table[1], child.block_table[1])]
    parent.token_ids.append(60)
    manager.prepare_append(parent)  # now the only holder: writes in place
    assert len(manager.pending_copies) == 1


def test_n_samples_prefill_the_prompt_once_and_share_its_blocks(qwen3_dense):
    hf_model, path = qwen3_dense
    engine = make_engine(path, block_size=4)
    prompt = list(range(20, 38))  # 18 tokens: 4 full blocks + a partial one
    engine.add_request("shared", prompt, {"temperature": 1.0, "n": 4, "max_new_tokens": 6, "ignore_eos": True,
                                          "sampling_seed": 3})
    finished = engine.step()  # the prefill step
    assert finished == [] and engine.runner.prefill_forwards == 1
    samples = [s for s in engine.scheduler.running if s.rid == "shared"]
    assert len(samples) == 4
    full_prompt_blocks = samples[0].block_table[:4]
    assert all(s.block_table[:4] == full_prompt_blocks for s in samples)
    assert all(engine.block_manager.ref_counts[b] == 4 for b in full_prompt_blocks)
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    assert engine.runner.prefill_forwards == 1
    assert len(outputs) == 4
    for output in outputs:  # each sample's logprobs are exact despite the shared, copied-on-write blocks
        assert (engine_logprobs(output) - hf_logprobs(hf_model, prompt, output["output_ids"])).abs().max() <= 1e-5
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_prefix_cache_hit_across_requests_keeps_results_exact(qwen3_dense):
    hf_model, path = qwen3_dense
    engine = make_engine(path, block_size=4)
    prompt = list(range(40, 61))
    engine.generate([prompt], {"temperature": 0, "max_new_tokens": 4})
    second = engine.generate([prompt + [7, 8]], {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})[0]
    assert second["meta_info"]["cached_tokens"] == 20
    reference = hf_logprobs(hf_model, prompt + [7, 8], second["output_ids"])
    assert (engine_logprobs(second) - reference).abs().max() <= 1e-5
    engine.flush_cache()
    third = engine.generate([prompt + [7, 8]], {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})[0]
    assert third["meta_info"]["cached_tokens"] == 0
    assert third["output_ids"] == second["output_ids"]
