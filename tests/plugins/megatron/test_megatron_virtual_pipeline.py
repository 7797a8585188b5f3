"""Virtual pipeline stages and uneven stages of ``--train-backend megatron`` on gloo trainer
processes, CPU, float32 (:class:`miles_megatron.pipeline.PipelineLayout`).

- PP 2 x VPP 2 (``--virtual-pipeline-model-parallel-size 2``): each rank holds two model
  chunks of one layer each (rank 0 layers 1 and 3, rank 1 layers 2 and 4; the embedding in
  rank 0's first chunk, the tied head in rank 1's last), run by Megatron-Core's interleaved
  schedule; the dynamic batch size gives three micro-batches, padded with a zero-share copy
  to a multiple of the pipeline size. Two optimizer steps give the losses, gradient norms and
  weights of one process (TP = PP = 1) within float32 tolerance; the gathered checkpoint
  (``--ckpt-format torch``: full weights and Adam moments from every chunk) loads back.
- Uneven stages (``--decoder-first-pipeline-num-layers 1``): the first rank one layer, the last
  three, same agreement.
- The layout rules (:meth:`PipelineLayout.from_config`): what Megatron cannot split is refused
  by name.
Skipped where megatron-core is not installed. On two GPUs (NCCL, bf16 autocast tolerances)::

    MILES_MEGATRON_TEST_DEVICE=cuda python -m pytest -q tests/plugins/megatron/test_megatron_virtual_pipeline.py
"""

from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
transformers = pytest.importorskip("transformers")

from tests.plugins.megatron.conftest import save_models  # noqa: E402
from tests.plugins.megatron.test_megatron_parallel import (  # noqa: E402,F401
    DEVICE,
    FLAGS,
    KEYS,
    LOSS_TOL,
    WEIGHT_TOL,
    _leave_groups,
    _one_process_run,
    clean_groups,
)
from tests.plugins.megatron.test_megatron_trainer import MODELS, make_samples, make_trainer  # noqa: E402

#: three micro-batches of at most 14 tokens (sample lengths 7, 7, 8, 7); the device of the ranks
DYNAMIC = ("--use-dynamic-batch-size", "--max-tokens-per-gpu", "14", "--device", DEVICE)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Four-layer tied Qwen3 and Qwen3-MoE (two layers per pipeline rank: one per model chunk)."""
    return save_models(tmp_path_factory.mktemp("virtual_pipeline"), {
        "qwen3_4l": lambda: _four_layers("qwen3"), "qwen3_moe_4l": lambda: _four_layers("qwen3_moe")})


def _four_layers(name: str):
    """The trainer tests' model ``name`` with four decoder layers."""
    config = MODELS[name]().to_dict()
    config.update(num_hidden_layers=4)
    config.pop("layer_types", None)  # (derived from the layer count)
    return transformers.AutoConfig.for_model(config.pop("model_type"), **config)


def _two_ranks() -> None:
    if DEVICE != "cpu" and torch.cuda.device_count() < 2:
        pytest.skip("MILES_MEGATRON_TEST_DEVICE=cuda needs 2 GPUs")


def _layer_numbers(gpt) -> list[int]:
    return [int(layer.layer_number) for layer in gpt.decoder.layers]


def _equal_to_one_process(models, flags: tuple[str, ...], check_layout, name: str = "qwen3_4l",
                          shared: tuple[str, ...] = ()) -> None:
    _two_ranks()
    samples = make_samples(routes="r3" in shared, layers=4)
    want, want_counters, expected, start = _one_process_run(models, name, samples, *DYNAMIC, *shared)
    group = make_trainer(models, name, "megatron", *FLAGS, *DYNAMIC, "--pipeline-model-parallel-size", "2",
                         "--actor-num-gpus-per-node", "2", *flags, *shared)
    try:
        check_layout(group.local.model)
        for step in range(2):
            got = group.train(samples)
            for key in KEYS:
                assert got[key] == pytest.approx(want[step][key], abs=LOSS_TOL), (step, key)
            if "r3" in shared:  # every layer's routes recorded and replayed: the one-process agreement
                counters, reference = group.rank_counters(), want_counters[step]
                assert counters["r3/agree"] / counters["r3/total"] == pytest.approx(
                    reference["r3/agree"] / reference["r3/total"], abs=1e-12), step
        exported = {k: v.float().cpu().clone() for k, v in group.named_weights_for_rollout()}
        expected = {k: v.float().cpu() for k, v in expected.items()}
        assert exported.keys() == expected.keys()
        assert max(float((exported[k] - expected[k]).abs().max()) for k in expected) < WEIGHT_TOL
        assert any(not torch.equal(exported[k], start[k].float().cpu()) for k in expected)  # it trained
        state = group.state_dict()  # every chunk's weights and moments, gathered
        assert state["optimizer"]["moments"]["exp_avg"].keys() == expected.keys()
        group.load_state_dict(state)
        after = dict(group.named_weights_for_rollout())
        assert all(torch.equal(after[k].float().cpu(), exported[k]) for k in expected)
    finally:
        group.stop()


def test_pp2_vpp2_interleaved_schedule_gives_the_one_process_steps(models, clean_groups):
    from megatron.core import parallel_state as ps

    def check_layout(policy):
        assert ps.get_virtual_pipeline_model_parallel_world_size() == 2
        chunks = policy.chunks
        assert [_layer_numbers(chunk) for chunk in chunks] == [[1], [3]]  # rank 0: virtual stages 0 and 2
        assert [(chunk.pre_process, chunk.post_process) for chunk in chunks] == [(True, False), (False, False)]

    _equal_to_one_process(models, ("--virtual-pipeline-model-parallel-size", "2"), check_layout)


@pytest.mark.slow
def test_pp2_vpp2_moe_with_recorded_routes_gives_the_one_process_steps(models, clean_groups):
    """R2 under virtual stages: each micro-batch is packed once per rank, so a rank's two chunks
    record their MoE layers' routes into one routing context (then shared over the pipeline)."""
    def check_layout(policy):
        assert sorted(policy.replay.routers) == [0, 2]  # both chunks' routers, by global layer

    _equal_to_one_process(models, ("--virtual-pipeline-model-parallel-size", "2"), check_layout, "qwen3_moe_4l",
                          ("--plugins", "r3", "--use-routing-replay"))


@pytest.mark.slow
def test_uneven_pipeline_stages_give_the_one_process_steps(models, clean_groups):
    def check_layout(policy):
        assert [_layer_numbers(chunk) for chunk in policy.chunks] == [[1]]  # the last rank: layers 2 to 4

    _equal_to_one_process(models, ("--decoder-first-pipeline-num-layers", "1"), check_layout)


def _layout(**flags):
    from miles_megatron.pipeline import PipelineLayout

    values = dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=None,
                  num_layers_per_virtual_pipeline_stage=None, decoder_first_pipeline_num_layers=None,
                  decoder_last_pipeline_num_layers=None)
    values.update(flags)
    return PipelineLayout.from_config(argparse.Namespace(**values), 8)


def test_pipeline_layouts_follow_megatrons_rules():
    assert _layout().rank_layers(8) == [4, 4]
    assert _layout(decoder_first_pipeline_num_layers=3).rank_layers(8) == [3, 5]  # the other ranks share the rest
    assert _layout(num_layers_per_virtual_pipeline_stage=2).vpp == 2  # 8 layers / (2 ranks x 2 per chunk)
    uneven = _layout(pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=1,
                     decoder_last_pipeline_num_layers=1)
    assert uneven.rank_layers(8) == [1, 3, 3, 1]
    assert uneven.transformer_kwargs() == {"pipeline_model_parallel_size": 4, "num_layers_in_first_pipeline_stage": 1,
                                           "num_layers_in_last_pipeline_stage": 1}
    refused = {
        "do not split evenly": dict(pipeline_model_parallel_size=3),
        "middle stages": dict(decoder_first_pipeline_num_layers=3, decoder_last_pipeline_num_layers=3),  # 2 left
        "split evenly into 4 model chunks": dict(virtual_pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=2,
                                               decoder_last_pipeline_num_layers=6),
        "disagree": dict(virtual_pipeline_model_parallel_size=4, num_layers_per_virtual_pipeline_stage=2),
        "need --pipeline-model-parallel-size > 1": dict(pipeline_model_parallel_size=1,
                                                         virtual_pipeline_model_parallel_size=2),
    }
    for message, flags in refused.items():
        with pytest.raises(ValueError, match=message):
            _layout(**flags)


@pytest.mark.slow
def test_a_vpp_checkpoint_with_the_distributed_optimizer_loads_without_virtual_stages(models, clean_groups, tmp_path):
    """PP 2 x VPP 2 with Megatron's distributed optimizer (one optimizer over both chunks) trains as
    one process does; its torch_dist checkpoint (each chunk's shards under the model's global keys)
    loads into PP 2 without virtual stages, whose next step is the PP 2 x VPP 2 group's."""
    from miles_host.checkpoint import read_checkpoint, save_checkpoint

    _two_ranks()
    flags = (*FLAGS, "--ckpt-format", "torch_dist", "--use-distributed-optimizer")  # (the later format wins)
    samples = make_samples()
    want, _, expected, _ = _one_process_run(models, "qwen3_4l", samples, *DYNAMIC)
    parallel = ("--pipeline-model-parallel-size", "2", "--actor-num-gpus-per-node", "2")
    group = make_trainer(models, "qwen3_4l", "megatron", *flags, *DYNAMIC, *parallel,
                         "--virtual-pipeline-model-parallel-size", "2")
    try:
        for step in range(2):
            got = group.train(samples)
            for key in KEYS:
                assert got[key] == pytest.approx(want[step][key], abs=LOSS_TOL), (step, key)
        weights = {k: v.float().cpu().clone() for k, v in group.named_weights_for_rollout()}  # (rank 0's: its own)
        assert max(float((weights[k] - expected[k].float().cpu()).abs().max()) for k in expected) < WEIGHT_TOL
        folder = save_checkpoint(str(tmp_path), 1, {"trainer": group.state_dict()}, write_shards=group.save_shards)
        third = group.train(samples)
    finally:
        group.stop()
    plain = make_trainer(models, "qwen3_4l", "megatron", *flags, *DYNAMIC, *parallel)
    try:
        plain.load_state_dict(read_checkpoint(folder)["trainer"])
        loaded = {k: v.float().cpu() for k, v in plain.named_weights_for_rollout()}
        assert all(torch.equal(loaded[k], weights[k]) for k in weights)
        again = plain.train(samples)
        for key in KEYS + ("train/lr",):
            assert again[key] == pytest.approx(third[key], abs=LOSS_TOL), key
    finally:
        plain.stop()
