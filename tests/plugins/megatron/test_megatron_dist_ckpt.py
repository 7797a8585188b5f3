"""Sharded checkpoints of ``--train-backend megatron`` (``--ckpt-format torch_dist``,
:mod:`miles_megatron.dist_ckpt`) on two gloo trainer processes, CPU, float32.

- Resume exact: two steps, a checkpoint written through the host's ``save_checkpoint``
  (each rank its own shards under ``iter_*/torch_dist``), two more steps, against a new
  trainer group loaded from that checkpoint (``read_checkpoint``) taking the same two
  steps: the same losses, gradient norms and weights, bit for bit, at TP 2 and PP 2.
- Another layout: the TP 2 checkpoint loaded by a one-process trainer and by two pipeline
  stages (dist_checkpointing reshards on load): the TP 2 weights, and the next steps' metrics
  within float32 tolerance of the TP 2 run (TP changes the order of sums).
- Slime's ``--ref-load`` / ``--load`` of a checkpoint in Megatron's own layout; ``--no-save-optim``.
- The optimizer state in the files is Megatron's ``FP32Optimizer`` layout: moments keyed
  ``optimizer.state.exp_avg.<model key>`` next to the model's keys.
Skipped where megatron-core is not installed.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytest.importorskip("transformers")

from tests.plugins.megatron.test_megatron_parallel import KEYS, _leave_groups, clean_groups  # noqa: E402,F401
from tests.plugins.megatron.test_megatron_trainer import make_samples, make_trainer, models  # noqa: E402,F401

FLAGS = ("--calculate-per-token-loss", "--entropy-coef", "0.01", "--use-kl-loss", "--kl-loss-coef", "0.1",
         "--worker-timeout", "120", "--ckpt-format", "torch_dist")

SIZE_FLAGS = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size"}


def _group(models, sizes: dict, *flags):
    """Trainer processes of ``sizes`` (``dp``: Megatron's data-parallel size, the remaining factor)."""
    args = [arg for key, size in sizes.items() if key != "dp" for arg in (SIZE_FLAGS[key], str(size))]
    world = 1
    for size in sizes.values():
        world *= size
    return make_trainer(models, "qwen3", "megatron", *FLAGS, *args, "--actor-num-gpus-per-node", str(world), *flags)


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().float().cpu().clone() for name, tensor in trainer.named_weights_for_rollout()}


def _save(trainer, directory, rollout_id: int):
    from miles_host.checkpoint import save_checkpoint

    return save_checkpoint(str(directory), rollout_id, {"trainer": trainer.state_dict()},
                           write_shards=trainer.save_shards)


def _two_steps(trainer, samples) -> list[dict]:
    return [trainer.train(samples) for _ in range(2)]


@pytest.mark.parametrize("sizes", [
    pytest.param({"tp": 2}, marks=pytest.mark.slow),  # (CI time: pp2 resumes a sharded checkpoint in the default run)
    {"pp": 2},
    # data-parallel replicas: one writes each shard (Megatron's replica ids), each DP rank's batch share differs
    pytest.param({"tp": 2, "dp": 2}, marks=pytest.mark.slow),
], ids=["tp2", "pp2", "dp2_tp2"])
def test_a_sharded_checkpoint_resumes_exactly(models, clean_groups, tmp_path, sizes):
    from miles_host.checkpoint import read_checkpoint
    from miles_megatron.dist_ckpt import SUBDIR

    samples = make_samples()
    group = _group(models, sizes)
    try:
        _two_steps(group, samples)
        folder = _save(group, tmp_path, 1)
        want = _two_steps(group, samples)  # the uninterrupted run's steps 3 and 4
        want_weights = _weights(group)
    finally:
        group.stop()
    files = sorted(p.name for p in (folder / SUBDIR).iterdir())
    assert "metadata.json" in files and sum(name.endswith(".distcp") for name in files) >= 2  # both ranks wrote
    state = read_checkpoint(folder)
    assert state["trainer"]["shards"] == str(folder / SUBDIR) and "model" not in state["trainer"]
    resumed = _group(models, sizes)
    try:
        resumed.load_state_dict(state["trainer"])
        got = _two_steps(resumed, samples)
        got_weights = _weights(resumed)
    finally:
        resumed.stop()
    for step in range(2):
        for key in KEYS:
            assert got[step][key] == want[step][key], (step, key)
    assert got_weights.keys() == want_weights.keys()
    assert all(torch.equal(got_weights[k], want_weights[k]) for k in want_weights)


def test_a_tp2_checkpoint_loads_into_one_process(models, clean_groups, tmp_path):
    """dist_checkpointing reshards on load: a TP 2 checkpoint gives one process the same model
    and optimizer, so its next steps follow the TP 2 run."""
    from megatron.core.dist_checkpointing import load_common_state_dict
    from megatron.core.dist_checkpointing.serialization import load_tensors_metadata

    from miles_host.checkpoint import read_checkpoint
    from miles_megatron.dist_ckpt import SUBDIR

    samples = make_samples()
    group = _group(models, {"tp": 2})
    try:
        _two_steps(group, samples)
        folder = _save(group, tmp_path, 1)
        saved_weights = _weights(group)
        want = _two_steps(group, samples)
        want_weights = _weights(group)
    finally:
        group.stop()
    _leave_groups()
    keys = load_tensors_metadata(str(folder / SUBDIR)).keys()
    assert "decoder.layers.self_attention.linear_qkv.weight" in keys
    assert "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight" in keys
    assert "optimizer.state.exp_avg_sq.embedding.word_embeddings.weight" in keys
    assert float(load_common_state_dict(str(folder / SUBDIR))["optimizer"]["state"]["common_step"]) == 2.0
    single = make_trainer(models, "qwen3", "megatron", *FLAGS)
    single.load_state_dict(read_checkpoint(folder)["trainer"])
    loaded = _weights(single)
    assert all(torch.equal(loaded[k], saved_weights[k]) for k in saved_weights)
    got = _two_steps(single, samples)
    for step in range(2):
        for key in KEYS:
            assert got[step][key] == pytest.approx(want[step][key], abs=1e-5), (step, key)
    got_weights = _weights(single)
    assert max(float((got_weights[k] - want_weights[k]).abs().max()) for k in want_weights) < 1e-5


def _megatron_checkpoint(models, root, iteration: int = 2):
    """A checkpoint in Megatron's own layout (``latest_checkpointed_iteration.txt`` and the torch_dist
    files straight in ``iter_*``, no miles ``state.pt``: what slime's HF -> torch_dist conversion or its
    Megatron trainer writes) of a one-process model trained two steps, and that model's weights."""
    from miles_megatron.dist_ckpt import save_model_shards

    single = make_trainer(models, "qwen3", "megatron", *FLAGS)
    _two_steps(single, make_samples())
    folder = root / f"iter_{iteration:07d}"
    folder.mkdir(parents=True)
    save_model_shards(single.model.gpt, folder, single.device)
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    weights = _weights(single)
    single.close()
    return weights


def test_slime_load_and_ref_load_of_a_megatron_torch_dist_checkpoint(models, clean_groups, tmp_path):
    """``--ref-load`` of a torch_dist checkpoint: reference model and starting policy from its shards
    (on TP 2: resharded); ``--load`` of one Megatron wrote: the policy starts from its weights, the
    reference from --hf-checkpoint; the host does not take it for a miles resume state, and a backend
    that cannot read it refuses it."""
    from miles_host.checkpoint import fresh_start_note, has_checkpoint, megatron_only

    root = tmp_path / "megatron"
    trained = _megatron_checkpoint(models, root)
    _leave_groups()
    assert megatron_only(str(root)) and not has_checkpoint(str(root))
    group = _group(models, {"tp": 2}, "--ref-load", str(root))
    try:
        policy = _weights(group)
        assert all(torch.equal(policy[k], trained[k]) for k in trained)
        assert group.reads_megatron_checkpoints and "rollout 0" in fresh_start_note(str(root), group)
    finally:
        group.stop()
    _leave_groups()
    for flag, reference_trained in (("--ref-load", True), ("--load", False)):
        single = make_trainer(models, "qwen3", "megatron", *FLAGS, flag, str(root))
        policy = _weights(single)
        assert all(torch.equal(policy[k], trained[k]) for k in trained), flag
        reference = single.ref_model.state_dict()["embed_tokens.weight"].float()
        assert torch.equal(reference, trained["embed_tokens.weight"]) == reference_trained, flag
        single.close()
    native = make_trainer(models, "qwen3", "native")
    with pytest.raises(ValueError, match="Megatron torch_dist checkpoint.*--train-backend megatron"):
        fresh_start_note(str(root), native)


def test_no_save_optim_writes_only_the_model(models, clean_groups, tmp_path):
    """``--no-save-optim``: no moments in the shards; loading gives the weights and a fresh optimizer."""
    from megatron.core.dist_checkpointing.serialization import load_tensors_metadata

    from miles_host.checkpoint import read_checkpoint
    from miles_megatron.dist_ckpt import SUBDIR

    single = make_trainer(models, "qwen3", "megatron", *FLAGS, "--no-save-optim")
    _two_steps(single, make_samples())
    folder = _save(single, tmp_path, 1)
    saved = _weights(single)
    single.close()
    keys = load_tensors_metadata(str(folder / SUBDIR)).keys()
    assert "embedding.word_embeddings.weight" in keys and not any(k.startswith("optimizer.") for k in keys)
    fresh = make_trainer(models, "qwen3", "megatron", *FLAGS)
    fresh.load_state_dict(read_checkpoint(folder)["trainer"])
    loaded = _weights(fresh)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert len(fresh.optimizer.state) == 0
    fresh.close()


@pytest.mark.slow
def test_a_tp2_checkpoint_loads_into_two_pipeline_stages(models, clean_groups, tmp_path):
    """TP 2 -> PP 2: each stage reads its layers (the global layer axis of Megatron's keys) whole."""
    from miles_host.checkpoint import read_checkpoint

    samples = make_samples()
    group = _group(models, {"tp": 2})
    try:
        _two_steps(group, samples)
        folder = _save(group, tmp_path, 1)
        saved = _weights(group)
        want = _two_steps(group, samples)
    finally:
        group.stop()
    _leave_groups()
    staged = _group(models, {"pp": 2})
    try:
        staged.load_state_dict(read_checkpoint(folder)["trainer"])
        loaded = _weights(staged)
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)
        got = _two_steps(staged, samples)
    finally:
        staged.stop()
    for step in range(2):
        for key in KEYS:
            assert got[step][key] == pytest.approx(want[step][key], abs=1e-5), (step, key)


def _resumed_in_one_process(models, tmp_path, *extra: str):
    """Two steps, a checkpoint, two more steps of one process; then a new trainer loaded from the
    checkpoint takes the same two steps: ``(want, want_weights, got, got_weights)``."""
    from miles_host.checkpoint import read_checkpoint

    samples = make_samples()
    flags = (*FLAGS, *extra)
    single = make_trainer(models, "qwen3", "megatron", *flags)
    _two_steps(single, samples)
    folder = _save(single, tmp_path, 1)
    want = _two_steps(single, samples)
    want_weights = _weights(single)
    single.close()
    resumed = make_trainer(models, "qwen3", "megatron", *flags)
    resumed.load_state_dict(read_checkpoint(folder)["trainer"])
    got = _two_steps(resumed, samples)
    got_weights = _weights(resumed)
    resumed.close()
    return want, want_weights, got, got_weights


def test_one_process_with_the_optimizer_on_cpu_resumes_exactly(models, clean_groups, tmp_path):
    """``--optimizer-cpu-offload``: the moments of the CPU masters go into the shards; a loaded trainer
    (masters refreshed from the loaded weights) takes the same two steps."""
    want, want_weights, got, got_weights = _resumed_in_one_process(models, tmp_path, "--optimizer-cpu-offload")
    assert [[step[key] for key in KEYS] for step in got] == [[step[key] for key in KEYS] for step in want]
    assert all(torch.equal(got_weights[k], want_weights[k]) for k in want_weights)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_process_on_a_gpu_resumes_from_its_shards(models, clean_groups, tmp_path):
    """The CUDA path (NCCL one-rank group, shards written from GPU tensors): a loaded trainer takes the
    uninterrupted run's next two steps (bf16 autocast: within 1e-5; the same kernels on the same inputs)."""
    want, want_weights, got, got_weights = _resumed_in_one_process(models, tmp_path, "--device", "cuda")
    for step in range(2):
        for key in KEYS:
            assert got[step][key] == pytest.approx(want[step][key], abs=1e-5), (step, key)
    assert max(float((got_weights[k] - want_weights[k]).abs().max()) for k in want_weights) < 1e-5
