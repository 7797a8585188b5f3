"""``--train-backend megatron`` over several gloo ranks on CPU (float32), started by the host's
trainer launcher: TP, EP and PP alone and combined (EP carved out of TP x DP as Megatron-Core's
grids do), and data parallelism with them (``--actor-num-gpus-per-node`` = TP x PP x DP, each DP
rank training on its share of the samples), on Megatron-Core's schedules (1F1B at PP > 1), DDP
and ``finalize_model_grads``.

Two optimizer steps give the one-process (TP = EP = PP = DP = 1) losses, gradient norms and
final weights; the weights gathered on rank 0 are complete under HF/native names; a checkpoint
(gathered optimizer state, ``--ckpt-format torch``) loads back into the ranks. PP runs a tied
dense model (the embedding's copy on the last stage, gradients summed over both) and an untied
MoE model with R3 replay and recomputation (global layer ids on each stage; 1F1B recomputes a
micro-batch after the next one's forward). TP with MoE keeps the experts whole (expert TP 1):
with and without sequence parallelism (R3 then routes the whole sequence on every TP rank and
keeps its shard). The dynamic batch size per DP rank gives the ranks uneven micro-batch counts.
Virtual and uneven pipeline stages: ``test_megatron_virtual_pipeline.py``; Megatron's distributed
optimizer: ``test_megatron_distributed_optimizer.py``. Skipped where megatron-core is not installed.

On GPUs (NCCL, bf16 autocast, so a bf16 tolerance; the four- and eight-rank cases need as many)::

    MILES_MEGATRON_TEST_DEVICE=cuda python -m pytest -q tests/plugins/megatron/test_megatron_parallel.py -k one_process
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytest.importorskip("transformers")

from tests.plugins.megatron.test_megatron_trainer import make_samples, make_trainer, models  # noqa: E402,F401

#: (the checkpoint checked here is the gathered one: --ckpt-format torch)
FLAGS = ("--calculate-per-token-loss", "--entropy-coef", "0.01", "--use-kl-loss", "--kl-loss-coef", "0.1",
         "--worker-timeout", "120", "--ckpt-format", "torch")
#: ``cuda``: the TP/EP/PP equivalence test on GPUs (NCCL), with bf16 autocast tolerances
DEVICE = os.environ.get("MILES_MEGATRON_TEST_DEVICE", "cpu")
LOSS_TOL, WEIGHT_TOL = (1e-5, 1e-5) if DEVICE == "cpu" else (2e-2, 1e-3)
KEYS = ("train/loss", "train/grad_norm", "train/pg_loss", "train/entropy_loss", "train/kl_loss")


def _leave_groups():
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def clean_groups():
    _leave_groups()
    yield
    _leave_groups()


def _one_process_run(models, name, samples, *flags):
    """Two steps in one process: their metrics and plugin counters, the final and the initial weights."""
    single = make_trainer(models, name, "megatron", *FLAGS, "--device", DEVICE, *flags)
    metrics, counters = [], []
    for _ in range(2):
        metrics.append(single.train(samples))
        counters.append(single.rank_counters())
    weights = dict(single.named_weights_for_rollout())
    start = single.ref_model.state_dict()
    _leave_groups()
    return metrics, counters, weights, start


def _agreement(counters: dict) -> float:
    assert counters["r3/total"] > 0
    return counters["r3/agree"] / counters["r3/total"]


SIZE_FLAGS = {"tp": "--tensor-model-parallel-size", "ep": "--expert-model-parallel-size",
              "pp": "--pipeline-model-parallel-size"}
#: sample lengths 7, 7, 8, 7: DP rank 0 gets samples 0 and 2 (two micro-batches of at most 14 tokens), rank 1
#: samples 1 and 3 (one), so rank 1 runs a zero-share copy to keep the ranks' collectives in step
UNEVEN_DP = ("--use-dynamic-batch-size", "--max-tokens-per-gpu", "14")


#: (model, model-parallel sizes, flags of the parallel run only, flags of both runs)
_LAYOUTS = [
    ("qwen3", {"tp": 2}, (), ()),
    ("qwen3", {"tp": 2}, ("--sequence-parallel",), ()),
    ("qwen3_moe", {"ep": 2}, (), ()),
    ("qwen3", {"pp": 2}, (), ()),
    # (recomputation re-runs each stage's layers in backward, 1F1B after the next forward: it replays the experts
    # its own forward chose)
    ("qwen3_moe", {"pp": 2}, ("--recompute-granularity", "full"), ("--plugins", "r3")),
    # four ranks: each stage sharded; under sequence parallelism the stages pass sequence shards
    ("qwen3", {"tp": 2, "pp": 2}, ("--sequence-parallel",), ()),
    ("qwen3_moe", {"ep": 2, "pp": 2}, (), ()),
    # R2 on the worker ranks too: their plugin state comes from miles_process_start (it was R3 there, and hung)
    ("qwen3_moe", {"ep": 2}, (), ("--plugins", "r3", "--use-routing-replay")),
    # TP with MoE: whole experts (expert TP 1), the TP ranks' copies of the tokens reach each expert
    ("qwen3_moe", {"tp": 2}, (), ()),
    # TP x EP on two ranks (expert TP 1): the EP group is the TP group, each rank half the heads and half the
    # experts (slime's qwen3-30B-A3B script's layout)
    ("qwen3_moe", {"tp": 2, "ep": 2}, (), ()),
    # under sequence parallelism the routers see sequence shards: R3 routes the whole sequence, keeps the shard
    ("qwen3_moe", {"tp": 2, "ep": 2}, ("--sequence-parallel",), ("--plugins", "r3")),
    # EP above TP: Megatron's 2 data-parallel replicas of each TP shard see the same batch, one expert per rank
    ("qwen3_moe", {"tp": 2, "ep": 4}, ("--sequence-parallel",), ()),
    # four ranks: each stage TP x EP, the stages pass sequence shards
    ("qwen3_moe", {"tp": 2, "ep": 2, "pp": 2}, ("--sequence-parallel",), ()),
    # 1F1B with warm-up, steady state and cool-down: four micro-batches over two stages (the one-process run
    # takes two: the host's shares make the step's loss independent of the split)
    ("qwen3", {"pp": 2}, ("--micro-batch-size", "1"), ()),
    # data parallelism with model parallelism: each DP rank trains on its half of the samples, DDP sums
    ("qwen3", {"tp": 2, "dp": 2}, ("--sequence-parallel",), ()),
    ("qwen3", {"pp": 2, "dp": 2}, (), ()),
    # the dynamic batch size per DP rank: uneven micro-batch counts; EP's token exchange spans the DP ranks, so
    # each micro-batch index is padded to one shape on both
    ("qwen3_moe", {"ep": 2}, UNEVEN_DP, ()),
    ("qwen3", {"tp": 2, "dp": 2}, UNEVEN_DP, ()),
    # two optimizer steps per rollout with R2 on two DP ranks: the old-logprob pass records each sample's routes
    # on the DP rank that trains it (both passes deal the samples by their index in the rollout)
    ("qwen3_moe", {"ep": 2}, (), ("--num-steps-per-rollout", "2", "--plugins", "r3", "--use-routing-replay")),
    # Megatron's DDP reducing bucket by bucket during the last micro-batch's backward (dense and expert buffers)
    ("qwen3", {"tp": 2, "dp": 2}, ("--overlap-grad-reduce", "--micro-batch-size", "1"), ()),
    ("qwen3_moe", {"ep": 2}, ("--overlap-grad-reduce", "--micro-batch-size", "1"), ()),
]
_LAYOUT_IDS = ["tp2", "tp2_sp", "ep2", "pp2", "pp2_moe_r3_recompute", "tp2_pp2_sp", "ep2_pp2", "ep2_r2", "tp2_moe",
               "tp2_ep2", "tp2_ep2_sp_r3", "tp2_ep4_sp", "tp2_ep2_pp2_sp", "pp2_1f1b_4mb", "dp2_tp2_sp", "dp2_pp2",
               "ep2_dp2_dynamic", "dp2_tp2_dynamic", "ep2_dp2_r2_two_steps", "dp2_tp2_overlap", "ep2_dp2_overlap"]
#: layouts whose parts the other cases cover (CI time on two cores): run with --run-slow. Plain TP is
#: also ``test_miles_run_with_model_parallel_trainers[tp2]``; plain PP, ``pp2_1f1b_4mb``; R2 on EP ranks,
#: ``ep2_dp2_r2_two_steps``; TP x EP, ``tp2_ep2_sp_r3``
_SLOW_LAYOUTS = {"tp2_pp2_sp", "ep2_pp2", "tp2_ep4_sp", "tp2_ep2_pp2_sp", "dp2_pp2", "dp2_tp2_dynamic",
                 "dp2_tp2_overlap", "tp2", "pp2", "ep2_r2", "tp2_ep2"}
_LAYOUT_CASES = [pytest.param(*layout, id=name, marks=[pytest.mark.slow] if name in _SLOW_LAYOUTS else [])
                 for layout, name in zip(_LAYOUTS, _LAYOUT_IDS, strict=True)]


@pytest.mark.parametrize("name,sizes,extra,shared", _LAYOUT_CASES)
def test_model_parallel_ranks_give_the_one_process_losses_and_weights(models, clean_groups, name, sizes, extra,
                                                                       shared):
    from miles_host.distributed.trainer_group import TrainerGroup
    from miles_megatron.parallel import Sizes

    tp, ep, pp = (sizes.get(key, 1) for key in ("tp", "ep", "pp"))
    # Megatron-Core's rule: TP x PP x DP ranks, DP a multiple of the smallest with EP dividing TP x DP (expert TP 1)
    dp = sizes.get("dp", ep // (2 if tp == 2 and ep % 2 == 0 else 1))
    world = tp * pp * dp
    assert Sizes(tp, ep, pp, dp).world == world
    if DEVICE != "cpu" and torch.cuda.device_count() < world:
        pytest.skip(f"MILES_MEGATRON_TEST_DEVICE=cuda needs {world} GPUs")
    samples = make_samples(routes="r3" in shared)
    want, want_counters, expected, start = _one_process_run(models, name, samples, *shared)
    size_flags = [arg for key, size in sizes.items() if key in SIZE_FLAGS for arg in (SIZE_FLAGS[key], str(size))]
    group = make_trainer(models, name, "megatron", *FLAGS, *size_flags, "--actor-num-gpus-per-node", str(world),
                         "--device", DEVICE, *extra, *shared)
    try:
        assert isinstance(group, TrainerGroup) and len(group.handles) == world - 1
        got = group.local.sizes
        assert (got.tp, got.ep, got.pp) == (tp, ep, pp)
        from megatron.core import parallel_state as ps

        assert (ps.get_data_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
                ps.get_expert_tensor_parallel_world_size()) == (dp, ep, 1)
        gpt = group.local.model.gpt
        assert group.local.ddp.ddp_config.overlap_grad_reduce == ("--overlap-grad-reduce" in extra)
        if pp == 2:  # rank 0 is the first stage: the embedding and layer 0 (of 2), no head
            assert [layer.layer_number for layer in gpt.decoder.layers] == [1]
            assert gpt.pre_process and not gpt.post_process and gpt.decoder.final_layernorm is None
            assert not hasattr(gpt, "output_layer")
            assert sorted(group.local.model.replay.routers) == ([0] if "moe" in name else [])
        if tp == 2:  # this rank holds half of the vocabulary and of the heads
            assert gpt.config.sequence_parallel == ("--sequence-parallel" in extra)
            if "--sequence-parallel" in extra:  # the norms run on this rank's positions; gradients reduced over TP
                assert type(gpt.decoder.layers[0].input_layernorm).__name__ == "RMSNorm"
                assert gpt.decoder.layers[0].input_layernorm.weight.sequence_parallel
            assert gpt.embedding.word_embeddings.weight.shape[0] == 32
            assert gpt.decoder.layers[0].self_attention.linear_qkv.weight.shape[0] == (4 + 2 * 2) * 16 // 2
        if "moe" in name:  # here EP's share of the experts, each whole (expert TP 1: 2 x 32 rows of fc1)
            assert len(gpt.decoder.layers[0].mlp.experts.local_experts) == 4 // ep
            assert gpt.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.weight.shape == (64, 64)
        for step in range(2):
            got = group.train(samples)
            for key in KEYS:
                assert got[key] == pytest.approx(want[step][key], abs=LOSS_TOL), (step, key)
            counters = group.rank_counters()  # every rank's routing agreement, summed
            if "r3" in shared:  # PP: each stage counts its own layers; TP/EP replicas count alike
                assert _agreement(counters) == pytest.approx(_agreement(want_counters[step]), abs=1e-12), step
                if tp == ep == 1:  # both stages' layers, routed once (recomputation replays the forward's ids)
                    assert counters["r3/total"] == want_counters[step]["r3/total"]
        exported = dict(group.named_weights_for_rollout())
        assert exported.keys() == expected.keys()  # every HF/native weight, full shapes
        exported = {k: v.float().cpu() for k, v in exported.items()}
        expected = {k: v.float().cpu() for k, v in expected.items()}
        start = {k: v.float().cpu() for k, v in start.items()}
        assert max(float((exported[k] - expected[k]).abs().max()) for k in expected) < WEIGHT_TOL
        assert any(not torch.equal(exported[k], start[k]) for k in expected)  # it trained
        # a checkpoint: full weights and moments on rank 0, loaded back into every rank
        state = group.state_dict()
        moments = state["optimizer"]["moments"]["exp_avg"]
        assert moments.keys() == expected.keys() and all(moments[k].shape == expected[k].shape for k in expected)
        group.load_state_dict(state)
        after = dict(group.named_weights_for_rollout())
        assert all(torch.equal(after[k].float().cpu(), exported[k]) for k in expected)
    finally:
        group.stop()


def _share_routes_rank(rank: int, store_path: str) -> None:
    import torch.distributed as dist

    from miles_host.models.context import RoutingContext
    from miles_megatron.pipeline import Stage, share_captured_routes

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        routing = RoutingContext(phase="old_logprob", captured={rank: torch.full((3, 2), rank)})  # own layer only
        share_captured_routes(routing, Stage(rank, 2, dist.group.WORLD, (0, 1)), torch.device("cpu"))
        assert sorted(routing.captured) == [0, 1]
        assert all(torch.equal(routing.captured[layer], torch.full((3, 2), layer)) for layer in (0, 1))
    finally:
        dist.destroy_process_group()


def test_pipeline_stages_share_the_routes_they_captured(tmp_path):
    """R2 records each MoE layer's routes where the layer runs: every stage gets all of them."""
    import torch.multiprocessing as mp

    mp.start_processes(_share_routes_rank, args=(str(tmp_path / "store"),), nprocs=2, start_method="spawn")


@pytest.mark.parametrize("flag", [
    pytest.param("--tensor-model-parallel-size", id="tp2"),
    # (slow for CI time: the PP2 ranks' steps against one process stay in the default run, above)
    pytest.param("--pipeline-model-parallel-size", id="pp2", marks=pytest.mark.slow),
])
def test_miles_run_with_model_parallel_trainers(tmp_path, clean_groups, flag):
    """``miles run --train-backend megatron --tensor-model-parallel-size 2`` (or PP 2): two
    trainer processes through the host's launcher (engine process, broadcast weight sync),
    --save-hf and a checkpoint from the gathered state, then a resume."""
    from miles_host.cli.main import main
    from miles_host.models import load_pretrained
    from miles_host.quickstart_preset import QUICKSTART_DIR

    common = ["--train-backend", "megatron", flag, "2", "--actor-num-gpus-per-node", "2",
              "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--no-progress",
              "--save", str(tmp_path / "ckpt"), "--worker-timeout", "120"]
    out = tmp_path / "out"
    assert main(["run", *common, "--num-rollout", "2", "--output-dir", str(out),
                 "--save-hf", str(tmp_path / "hf")]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert len(steps) == 2 and all(r["train/grad_norm"] > 0 for r in steps)
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-5 for r in steps)
    # the weights went to the engine bucket by bucket (streamed: counted all the same)
    assert any(r.get("perf/weight_sync_bytes", 0) > 0 for r in rows)
    saved = load_pretrained(tmp_path / "hf").state_dict()
    initial = load_pretrained(QUICKSTART_DIR / "model").state_dict()
    assert saved.keys() == initial.keys() and any(not torch.equal(saved[k], initial[k]) for k in saved)
    assert all(saved[k].shape == initial[k].shape for k in saved)
    resumed = tmp_path / "resumed"
    assert main(["run", *common, "--num-rollout", "3", "--output-dir", str(resumed), "--load", str(tmp_path / "ckpt")]) == 0
    assert [json.loads(line)["rollout_id"] for line in (resumed / "metrics.jsonl").read_text().splitlines()][0] == 2
