"""Megatron torch_dist checkpoint -> HF safetensors without gathering the model on one rank
(``miles_host.models.save_buckets`` over ``miles_megatron.weight_buckets``).

A one-process megatron trainer trains two steps and writes its model shards in Megatron's
layout, and its HF checkpoint the one-process way (``save_pretrained`` of the full state).
A TP2 trainer group (TP2 x PP2 with ``--run-slow``) reads the shards (``--ref-load``, each
rank its own) and writes the HF checkpoint one safetensors shard per bucket: transformers
loads both to the same config and weights.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
transformers = pytest.importorskip("transformers")

from tests.plugins.megatron.test_megatron_dist_ckpt import _group, _two_steps  # noqa: E402
from tests.plugins.megatron.test_megatron_parallel import FLAGS, _leave_groups, clean_groups  # noqa: E402,F401
from tests.plugins.megatron.test_megatron_trainer import make_samples, make_trainer, models  # noqa: E402,F401

BUCKET_BYTES = 64 << 10


def _one_process_checkpoints(models, root, hf):
    """Two steps in one process; its torch_dist model shards under ``root`` (Megatron's layout)
    and its HF checkpoint in ``hf`` from the full state."""
    from miles_host.models import save_pretrained
    from miles_megatron.dist_ckpt import save_model_shards

    single = make_trainer(models, "qwen3", "megatron", *FLAGS)
    _two_steps(single, make_samples())
    folder = root / "iter_0000002"
    folder.mkdir(parents=True)
    save_model_shards(single.model.gpt, folder, single.device)
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    save_pretrained(single.model, hf, state_dict=single.full_state_dict())
    single.close()


@pytest.mark.parametrize("sizes", [
    pytest.param({"tp": 2}, id="tp2"),
    pytest.param({"tp": 2, "pp": 2}, id="tp2_pp2", marks=pytest.mark.slow),
])
def test_torch_dist_checkpoint_converts_to_the_one_process_hf_checkpoint(models, clean_groups, tmp_path, sizes):
    from miles_host.models.save_buckets import INDEX, save_hf_in_buckets

    root, reference, out = tmp_path / "megatron", tmp_path / "reference", tmp_path / "converted"
    _one_process_checkpoints(models, root, reference)
    _leave_groups()
    group = _group(models, sizes, "--ref-load", str(root))
    try:
        files = save_hf_in_buckets(group, out, BUCKET_BYTES)
    finally:
        group.stop()
    assert len(files) > 2 and sorted(p.name for p in out.glob("*.safetensors")) == sorted(files)
    index = json.loads((out / INDEX).read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert json.loads((out / "config.json").read_text()) == json.loads((reference / "config.json").read_text())
    want = transformers.AutoModelForCausalLM.from_pretrained(reference, torch_dtype=torch.float32).state_dict()
    got = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    start = transformers.AutoModelForCausalLM.from_pretrained(models[0]["qwen3"], torch_dtype=torch.float32)
    assert any(not torch.equal(start.state_dict()[k], want[k]) for k in want)  # the checkpoint is the trained one
