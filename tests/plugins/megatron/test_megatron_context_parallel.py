"""``--context-parallel-size 2`` on the megatron backend (gloo ranks on CPU, float32).

Each CP rank holds Megatron's load-balanced chunks of every packed sequence (chunks ``r``
and ``2 * CP - 1 - r``), attends with the group's gathered keys and values through the
local ``ContextParallelAttention``, and Megatron's DDP sums the gradients over DP x CP.
Two optimizer steps give the one-process losses, gradient norms and final weights. On GPUs
(``MILES_MEGATRON_TEST_DEVICE=cuda``, NCCL, bf16 tolerances) through ``bench/gpu_suite.sh
megatron_parallel``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytest.importorskip("transformers")

from tests.plugins.megatron.test_megatron_parallel import (  # noqa: E402
    DEVICE,
    FLAGS,
    KEYS,
    LOSS_TOL,
    WEIGHT_TOL,
    _one_process_run,
    clean_groups,  # noqa: F401
)
from tests.plugins.megatron.test_megatron_trainer import make_samples, make_trainer, models  # noqa: E402,F401

SIZE_FLAGS = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
              "cp": "--context-parallel-size"}


def test_chunks_and_mask_follow_megatrons_load_balanced_split():
    """Rank r of N keeps chunks r and 2N-1-r; a query row sees the key rows at or before it."""
    from miles_megatron.context_parallel import ContextShard, chunk_rows

    assert chunk_rows(8, 2, 0).tolist() == [0, 1, 6, 7] and chunk_rows(8, 2, 1).tolist() == [2, 3, 4, 5]
    gathered = torch.cat([chunk_rows(8, 2, r) for r in range(2)])
    shard = ContextShard(8, chunk_rows(8, 2, 1), gathered)
    mask = shard.causal_mask()[0, 0]
    full = torch.triu(torch.ones(8, 8, dtype=torch.bool), diagonal=1)  # the one-rank mask, [query, key]
    assert torch.equal(mask, full[shard.local_S][:, gathered])
    with pytest.raises(ValueError, match="multiple of 4"):
        chunk_rows(6, 2, 0)


def test_dynamic_batches_hold_max_tokens_per_gpu_times_cp():
    """slime's budget: a CP group splits each micro-batch's sequences, so it holds up to
    ``--max-tokens-per-gpu`` x CP tokens (samples of 7, 7, 8 and 7 tokens, 8 per GPU)."""
    from miles_host.config import MilesConfig
    from miles_megatron.parallel import Sizes
    from miles_megatron.schedule import data_parallel_micro_batches

    samples = make_samples()
    config = MilesConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=8)
    counts = {cp: [len(m.samples) for m in data_parallel_micro_batches(samples, config, Sizes(cp=cp))] for cp in (1, 2)}
    assert counts == {1: [1, 1, 1, 1], 2: [2, 2]}
    assert config.max_tokens_per_gpu == 8


#: (model, sizes, flags of the parallel run, flags of both runs)
_LAYOUTS = [
    pytest.param("qwen3", {"cp": 2}, (), (), id="cp2"),
    # the stages pass each CP rank's rows on
    pytest.param("qwen3", {"cp": 2, "pp": 2}, (), (), id="cp2_pp2", marks=pytest.mark.slow),
    # sequence parallelism inside each CP rank's rows
    pytest.param("qwen3", {"cp": 2, "tp": 2}, ("--sequence-parallel",), (), id="cp2_tp2_sp", marks=pytest.mark.slow),
    # the dynamic batch size: two micro-batches of 16 tokens under CP 2, four of 8 in one process
    pytest.param("qwen3", {"cp": 2}, (), ("--use-dynamic-batch-size", "--max-tokens-per-gpu", "8"), id="cp2_dynamic",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name,sizes,extra,shared", _LAYOUTS)
def test_context_parallel_ranks_give_the_one_process_losses_and_weights(models, clean_groups, name, sizes, extra,
                                                                         shared):
    from megatron.core import parallel_state as ps

    from miles_megatron.context_parallel import ContextParallelAttention

    world = 1
    for size in sizes.values():
        world *= size
    if DEVICE != "cpu" and torch.cuda.device_count() < world:
        pytest.skip(f"MILES_MEGATRON_TEST_DEVICE=cuda needs {world} GPUs")
    samples = make_samples()
    want, _, expected, start = _one_process_run(models, name, samples, *shared)
    size_flags = [arg for key, size in sizes.items() for arg in (SIZE_FLAGS[key], str(size))]
    group = make_trainer(models, name, "megatron", *FLAGS, *size_flags, "--actor-num-gpus-per-node", str(world),
                         "--device", DEVICE, *extra, *shared)
    try:
        assert (ps.get_context_parallel_world_size(), ps.get_data_parallel_world_size()) == (2, 1)
        attention = group.local.model.gpt.decoder.layers[0].self_attention.core_attention
        assert type(attention) is ContextParallelAttention
        for step in range(2):
            got = group.train(samples)
            for key in KEYS:
                assert got[key] == pytest.approx(want[step][key], abs=LOSS_TOL), (step, key)
        exported = {k: v.float().cpu() for k, v in group.named_weights_for_rollout()}
        assert exported.keys() == expected.keys()
        assert max(float((exported[k] - expected[k].float().cpu()).abs().max()) for k in expected) < WEIGHT_TOL
        assert any(not torch.equal(exported[k], start[k].float().cpu()) for k in expected)  # it trained
    finally:
        group.stop()


def test_context_parallelism_refuses_moe_and_mla_models():
    from types import SimpleNamespace

    from miles_megatron.context_parallel import check_context_parallel

    check_context_parallel(SimpleNamespace(moe=None, mla=None), 2)
    with pytest.raises(ValueError, match="context-parallel-size 2 with MoE layers"):
        check_context_parallel(SimpleNamespace(moe=object(), mla=None), 2)
    with pytest.raises(ValueError, match="multi-latent attention"):
        check_context_parallel(SimpleNamespace(moe=None, mla=object()), 2)
