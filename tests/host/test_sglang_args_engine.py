"""The embedded engine built with SGLang's server flags: each honoured flag is the engine's knob."""

from __future__ import annotations

import pytest
import torch

from miles_host.builtin.rollout import check_engine_sequences
from miles_host.config import MilesConfig
from miles_host.plugin_manager import MilesPluginManager
from miles_host.rollout_backend import EmbeddedRolloutBackend
from miles_host.sglang_embedded import check_kv_cache_dtype, engine_kwargs_from_options
from tests.loop.conftest import build_tiny_policy


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("sglang_args_engine") / "model")


def test_the_engine_receives_the_honoured_sglang_flags(tiny_model):
    config = MilesConfig(
        hf_checkpoint=str(tiny_model), device="cpu", sglang_context_length=96, sglang_max_running_requests=8,
        sglang_chunked_prefill_size=512, sglang_max_prefill_tokens=1024, sglang_max_total_tokens=2048,
        sglang_disable_cuda_graph=True, sglang_disable_radix_cache=True, sglang_enable_deterministic_inference=True,
        sglang_disable_overlap_schedule=True, sglang_mem_fraction_static=0.5, sglang_kv_cache_dtype="auto",
        sglang_cuda_graph_bs=[8, 1, 2, 4, 16], sglang_cuda_graph_max_bs=4,
        sglang_ep_size=8,  # no meaning here: leaves the engine as it is
    )
    manager = MilesPluginManager()
    manager.activate()
    engine = EmbeddedRolloutBackend(config, manager).engine
    cfg = engine.config
    assert (cfg.max_model_len, cfg.max_num_seqs, cfg.mem_fraction_static) == (96, 8, 0.5)
    assert cfg.max_num_batched_tokens == 512  # the smaller of the two prefill budgets
    assert cfg.kv_cache_tokens == 2048 and cfg.max_kv_cache_tokens == 2048
    assert engine.num_kv_cache_tokens == 2048  # the pool SGLang's --max-total-tokens asks for
    assert cfg.enforce_eager and not cfg.enable_prefix_caching and cfg.batch_invariant
    assert cfg.overlap_schedule is False and cfg.kv_cache_dtype == torch.float32  # auto: the model's dtype
    assert cfg.cuda_graph_batch_sizes == [1, 2, 4]  # the listed sizes up to the maximum


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_decode_graphs_are_captured_for_the_given_batch_sizes(tiny_model):
    from miles_host.rollout import Engine

    engine = Engine.from_pretrained(str(tiny_model), dtype=torch.bfloat16, device="cuda", mem_fraction_static=0.2,
                                    max_num_seqs=8, cuda_graph_batch_sizes=[1, 3, 64])
    assert engine.runner.graphs.sizes == [1, 3]  # 64 > max_num_seqs: batches above 3 decode eagerly
    engine.add_request("r", [2, 3, 4], {"max_new_tokens": 4, "temperature": 0.0, "n": 2})
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert len(outputs) == 2 and engine.runner.graphs.num_replays > 0


def test_defaults_leave_the_engine_defaults():
    kwargs, ignored = engine_kwargs_from_options({"chunked-prefill-size": -1, "disable-radix-cache": False,
                                                  "kv-cache-dtype": "auto", "dp-size": 8})
    assert kwargs == {} and ignored == ["dp-size"]
    assert engine_kwargs_from_options({"kv-cache-dtype": "fp8_e4m3", "cuda-graph-backend-decode": "disabled"}) == (
        {"enforce_eager": True}, ["kv-cache-dtype"])


def test_one_knob_given_twice_with_different_values_is_refused(tiny_model):
    config = MilesConfig(hf_checkpoint=str(tiny_model), device="cpu", rollout_max_context_len=64,
                         sglang_context_length=96)
    with pytest.raises(ValueError, match="--rollout-max-context-len 64 and --sglang-context-length 96"):
        check_engine_sequences(config)
    config = MilesConfig(hf_checkpoint=str(tiny_model), device="cpu", n_samples_per_prompt=16,
                         sglang_max_running_requests=8)
    with pytest.raises(ValueError, match="--n-samples-per-prompt 16 exceeds the 8 sequences"):
        check_engine_sequences(config)


def test_a_bf16_kv_cache_needs_a_bf16_model():
    check_kv_cache_dtype(MilesConfig(device="cpu", dtype="bfloat16", sglang_kv_cache_dtype="bf16"))
    with pytest.raises(ValueError, match="--sglang-kv-cache-dtype bf16 with a float32 model"):
        check_kv_cache_dtype(MilesConfig(device="cpu", dtype="float32", sglang_kv_cache_dtype="bf16"))
