"""``--use-distributed-optimizer`` of ``--train-backend megatron``: Megatron-Core's optimizer
(``get_megatron_optimizer``, its distributed optimizer sharding the moments over the DP ranks,
its gradient norm and clipping) on gloo trainer processes, CPU, float32
(:mod:`miles_megatron.megatron_optimizer`).

- DP 2 x PP 2: two optimizer steps give the losses, gradient norms and weights of the native
  trainer in one process (the host's ``torch.optim.AdamW`` and ``clip_grad_norm_``) within
  float32 tolerance, and with ``--clip-grad`` small enough to clip.
- Its state in a torch_dist checkpoint (Megatron's sharded optimizer state, each rank its
  slice): loaded back after a further step, that step repeats bit for bit (losses, gradient
  norm, weights), so moments, step count and learning-rate schedule were restored.
Skipped where megatron-core is not installed. On GPUs (NCCL, bf16 autocast tolerances;
DP 2 x PP 2 needs four)::

    MILES_MEGATRON_TEST_DEVICE=cuda python -m pytest -q tests/plugins/megatron/test_megatron_distributed_optimizer.py
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytest.importorskip("transformers")

from tests.plugins.megatron.test_megatron_parallel import (  # noqa: E402,F401
    DEVICE,
    KEYS,
    LOSS_TOL,
    WEIGHT_TOL,
    _leave_groups,
    clean_groups,
)
from tests.plugins.megatron.test_megatron_trainer import make_samples, make_trainer, models  # noqa: E402,F401

#: ``--clip-grad`` below the first step's norm (about 3): Megatron clips as the host does;
#: a warm-up so the schedule's learning rate changes between steps
FLAGS = ("--calculate-per-token-loss", "--entropy-coef", "0.01", "--use-kl-loss", "--kl-loss-coef", "0.1",
         "--worker-timeout", "120", "--ckpt-format", "torch_dist", "--clip-grad", "1.0", "--lr-warmup-iters", "4",
         "--device", DEVICE)


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().float().cpu().clone() for name, tensor in trainer.named_weights_for_rollout()}


def _one_process_then_group(models, name: str, samples, *parallel: str):
    """Two steps of the native trainer in one process (their metrics and final weights), then
    the trainer group of ``parallel`` flags with the distributed optimizer (skipped on GPUs where
    there are fewer than its ``--actor-num-gpus-per-node``)."""
    world = int(parallel[parallel.index("--actor-num-gpus-per-node") + 1])
    if DEVICE != "cpu" and torch.cuda.device_count() < world:
        pytest.skip(f"MILES_MEGATRON_TEST_DEVICE=cuda needs {world} GPUs")
    single = make_trainer(models, name, "native", *FLAGS)
    assert type(single.optimizer) is torch.optim.AdamW  # the reference: the host's optimizer
    want = [single.train(samples) for _ in range(2)]
    expected = _weights(single)
    _leave_groups()
    group = make_trainer(models, name, "megatron", *FLAGS, *parallel, "--use-distributed-optimizer")
    return want, expected, group


def _same_steps(group, samples, want: list[dict], keys=KEYS) -> None:
    for step in range(2):
        got = group.train(samples)
        for key in keys:
            assert got[key] == pytest.approx(want[step][key], abs=LOSS_TOL), (step, key)


def test_dp2_pp2_distributed_optimizer_gives_the_one_process_steps_and_resumes_exactly(models, clean_groups,
                                                                                       tmp_path):
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from miles_host.checkpoint import read_checkpoint, save_checkpoint

    samples = make_samples()
    want, expected, group = _one_process_then_group(models, "qwen3", samples, "--pipeline-model-parallel-size", "2",
                                                    "--actor-num-gpus-per-node", "4")
    try:
        assert ps.get_data_parallel_world_size() == 2 and ps.get_pipeline_model_parallel_world_size() == 2
        inner = group.local.optimizer.megatron.chained_optimizers
        assert [type(o) for o in inner] == [DistributedOptimizer]
        stage = sum(p.numel() for p in group.local.model.gpt.parameters())
        moments = inner[0].optimizer.state.values()
        _same_steps(group, samples, want, KEYS + ("train/lr",))
        assert min(w["train/grad_norm"] for w in want) > 1.0  # so the steps were clipped
        # ZeRO-1: this rank's moments cover its half of the stage's (DP-padded) parameters
        assert 0 < sum(s["exp_avg"].numel() for s in moments) <= stage // 2 + 64
        exported = _weights(group)
        assert exported.keys() == expected.keys()
        assert max(float((exported[k] - expected[k]).abs().max()) for k in expected) < WEIGHT_TOL
        folder = save_checkpoint(str(tmp_path), 1, {"trainer": group.state_dict()}, write_shards=group.save_shards)
        again = group.train(samples)  # the third step, then the same after loading the checkpoint
        again_weights = _weights(group)
        group.load_state_dict(read_checkpoint(folder)["trainer"])
        assert all(torch.equal(a, b) for a, b in zip(_weights(group).values(), exported.values()))
        resumed = group.train(samples)
        for key in KEYS + ("train/lr",):
            assert resumed[key] == again[key], key
        final = _weights(group)
        assert all(torch.equal(final[k], again_weights[k]) for k in again_weights)
    finally:
        group.stop()


@pytest.mark.slow
def test_ep2_moe_distributed_optimizer_gives_the_one_process_steps(models, clean_groups):
    """MoE under EP 2 (DP 2): Megatron chains a dense and an expert distributed optimizer (the
    experts' state sharded over their expert-data-parallel group); the norm spans both."""
    samples = make_samples()
    want, expected, group = _one_process_then_group(models, "qwen3_moe", samples, "--expert-model-parallel-size", "2",
                                                    "--actor-num-gpus-per-node", "2")
    try:
        assert len(group.local.optimizer.megatron.chained_optimizers) == 2  # dense, experts
        _same_steps(group, samples, want)
        exported = _weights(group)
        assert max(float((exported[k] - expected[k]).abs().max()) for k in expected) < WEIGHT_TOL
    finally:
        group.stop()


@pytest.mark.parametrize("flags, message", [
    (("--save", "ckpt", "--ckpt-format", "torch"), "save with --ckpt-format torch_dist"),
    (("--optimizer-cpu-offload",), "distributed optimizer keeps its state on the trainer.s device"),
])
def test_what_the_distributed_optimizer_cannot_do_is_refused_by_name(models, flags, message):
    with pytest.raises(ValueError, match=message):
        make_trainer(models, "qwen3", "megatron", "--use-distributed-optimizer", *flags)
