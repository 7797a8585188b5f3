"""LoRA in the trainers: only the adapters train (no gradients or optimizer state for the
base), the engine gets the merged weights, checkpoints and ``--save-hf`` carry the PEFT
adapter (``--merge-lora``: the merged model), and data-parallel / FSDP2 trainers over 2
gloo processes train the adapters as one process does."""

from __future__ import annotations

import json

import pytest
import torch

from miles_host.checkpoint import load_checkpoint
from miles_host.config import MilesConfig
from miles_host.lora import apply_lora, load_adapter
from miles_host.models import load_pretrained
from tests.distributed.conftest import base_args, read_metrics, resolve, run_launched, run_one_process

LORA = ("--lora-rank", "4", "--lora-alpha", "8")


def _is_lora(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def test_only_the_adapters_train_and_the_outputs_carry_them(tiny_task, tmp_path, signal_reward):
    model, data = tiny_task
    argv = base_args(model, data, tmp_path / "out", "--num-rollout", "2", *LORA, *signal_reward,
                     "--save", str(tmp_path / "ck"), "--save-hf", str(tmp_path / "hf_{rollout_id}"))
    assert run_one_process(argv) == 0
    metrics = read_metrics(tmp_path / "out")
    start = load_pretrained(str(model), dtype=torch.float32).state_dict()
    assert metrics[-1]["lora/trainable_params"] == 2 * 4 * (64 + 64 + 64 + 32 + 64 + 32 + 64 + 64 + 2 * (64 + 128)
                                                           + 128 + 64)
    assert metrics[-1]["lora/trainable_fraction"] == pytest.approx(
        metrics[-1]["lora/trainable_params"] / metrics[-1]["lora/total_params"])
    # the engine samples from the trained adapters: its log-probs are the trainer's up to float32
    # rounding (an engine left on the base weights differs by ~1e-2 from the second rollout on)
    assert all(m["train/train_rollout_logprob_abs_diff_max"] < 1e-5 for m in metrics)
    trainer = load_checkpoint(str(tmp_path / "ck"))["trainer"]
    weights = trainer["model"]
    for name, tensor in start.items():  # the base never moved
        assert torch.equal(weights[name], tensor), name
    lora = [name for name in weights if _is_lora(name)]
    assert any(weights[n].abs().max() > 0 for n in lora if ".lora_B." in n)  # the adapters trained
    assert len(trainer["optimizer"]["state"]) == len(lora)  # Adam state for the adapters only
    for adapter_dir in (tmp_path / "ck" / "iter_0000001" / "adapter", tmp_path / "hf_1"):
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
        assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
        fresh = load_pretrained(str(model), dtype=torch.float32)
        apply_lora(fresh, MilesConfig(hf_checkpoint=str(model), lora_rank=4, lora_alpha=8))
        load_adapter(fresh, adapter_dir)
        assert all(torch.equal(fresh.state_dict()[n], weights[n]) for n in lora)
    assert not (tmp_path / "hf_1" / "config.json").exists()  # an adapter, not a model


def test_the_engine_gets_the_merged_weights(tiny_task, tmp_path):
    """``named_weights_for_rollout``: the native names of the plain model, each adapted weight
    ``W + alpha / r * B @ A`` (float64 reference) on its HF part's rows."""
    from miles_host.trainer import NativeTrainer

    model, data = tiny_task
    config, manager = resolve(base_args(model, data, tmp_path, *LORA, "--target-modules", "o_proj,k_proj"))
    trainer = NativeTrainer(config, manager)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in trainer.model.named_parameters():
            if ".lora_B." in name:
                parameter.normal_(0, 0.3)
    state = trainer.model.state_dict()
    named = dict(trainer.named_weights_for_rollout())
    assert named.keys() == load_pretrained(str(model), dtype=torch.float32).state_dict().keys()
    for layer in range(2):
        prefix = f"layers.{layer}.attn."
        a, b = state[prefix + "o_proj.lora_A.o_proj"].double(), state[prefix + "o_proj.lora_B.o_proj"].double()
        want = state[prefix + "o_proj.weight"].double() + 2.0 * b @ a
        assert torch.allclose(named[prefix + "o_proj.weight"].double(), want, rtol=0, atol=1e-6)
        a, b = state[prefix + "qkv_proj.lora_A.k_proj"].double(), state[prefix + "qkv_proj.lora_B.k_proj"].double()
        qkv = state[prefix + "qkv_proj.weight"].double().clone()
        qkv[64:96] += 2.0 * b @ a  # k's rows: after 4 heads x 16 of q
        assert torch.allclose(named[prefix + "qkv_proj.weight"].double(), qkv, rtol=0, atol=1e-6)
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for n, p in trainer.model.named_parameters() if _is_lora(n)}


def test_save_hf_merge_lora_writes_the_merged_model(tiny_task, tmp_path, signal_reward):
    model, data = tiny_task
    argv = base_args(model, data, tmp_path / "out", "--num-rollout", "1", *LORA, *signal_reward,
                     "--save", str(tmp_path / "ck"), "--save-hf", str(tmp_path / "hf"), "--merge-lora")
    assert run_one_process(argv) == 0
    weights = load_checkpoint(str(tmp_path / "ck"))["trainer"]["model"]
    exported = load_pretrained(str(tmp_path / "hf"), dtype=torch.float32).state_dict()
    prefix = "layers.1.mlp."
    a, b = weights[prefix + "down_proj.lora_A.down_proj"].double(), weights[prefix + "down_proj.lora_B.down_proj"].double()
    want = weights[prefix + "down_proj.weight"].double() + 2.0 * b @ a
    assert torch.allclose(exported[prefix + "down_proj.weight"].double(), want, rtol=0, atol=1e-6)
    assert not (tmp_path / "hf" / "adapter_config.json").exists()


def one_and_two_gloo_trainers(model, data, tmp_path, backend: str, *flags: str, rel: float = 1e-6,
                              worker_timeout: int = 90) -> tuple[dict, dict]:
    """Two rollouts of ``flags`` in one process and with two gloo ``backend`` trainers: every
    non-perf metric agrees (``rel``); returns both checkpoints' trainer states (one, two)."""
    common = ("--num-rollout", "2", "--global-batch-size", "8", *flags)
    one = base_args(model, data, tmp_path / "one", *common, "--save", str(tmp_path / "c1"))
    many = base_args(model, data, tmp_path / "many", *common, "--save", str(tmp_path / "c2"), "--weight-sync", "broadcast")
    assert run_one_process(one) == 0
    assert run_launched(many, worker_timeout=worker_timeout, actor_num_gpus_per_node=2, rollout_num_gpus=1,
                        train_backend=backend) == 0
    for want, have in zip(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "many")):
        for key in want:
            if not key.startswith("perf/"):
                assert have[key] == pytest.approx(want[key], rel=rel, abs=1e-6), key
    a, b = (load_checkpoint(str(tmp_path / folder))["trainer"] for folder in ("c1", "c2"))
    assert a["model"].keys() == b["model"].keys()
    return a, b


@pytest.mark.parametrize("backend", ["native_dp", "fsdp"])
def test_two_gloo_trainers_train_the_adapters_as_one_process(tiny_task, tmp_path, signal_reward, backend):
    model, data = tiny_task
    a, b = one_and_two_gloo_trainers(model, data, tmp_path, backend, *LORA, *signal_reward)
    for name in a["model"]:
        assert (a["model"][name] - b["model"][name]).abs().max() <= 1e-5, name
    assert len(b["optimizer"]["state"]) == sum(_is_lora(n) for n in b["model"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_lora_on_cuda_trains_under_bf16_autocast_and_syncs_merged_weights(tiny_task, tmp_path, signal_reward):
    """On the GPU: adapters train under bf16 autocast, the engine runs the merged weights in
    bf16; trainer and engine log-probs differ by bf16 rounding only."""
    model, data = tiny_task
    argv = base_args(model, data, tmp_path / "out", "--num-rollout", "3", "--device", "cuda", *LORA, *signal_reward,
                     "--save-hf", str(tmp_path / "hf"))
    assert run_one_process(argv) == 0
    metrics = read_metrics(tmp_path / "out")
    assert all(m["lora/trainable_fraction"] < 1 for m in metrics)
    assert all(m["train/train_rollout_logprob_abs_diff"] < 5e-2 for m in metrics)
    assert (tmp_path / "hf" / "adapter_model.safetensors").is_file()


def test_a_resumed_lora_run_continues_like_an_uninterrupted_one(tiny_task, tmp_path, signal_reward):
    model, data = tiny_task
    common = (*LORA, "--lora-dropout", "0.1", *signal_reward)
    straight = base_args(model, data, tmp_path / "straight", "--num-rollout", "3", *common)
    first = base_args(model, data, tmp_path / "first", "--num-rollout", "2", *common, "--save", str(tmp_path / "ck"))
    second = base_args(model, data, tmp_path / "second", "--num-rollout", "3", *common, "--load", str(tmp_path / "ck"))
    for argv in (straight, first, second):
        assert run_one_process(argv) == 0
    want, have = read_metrics(tmp_path / "straight")[2], read_metrics(tmp_path / "second")[0]
    for key in want:
        if not key.startswith("perf/"):
            assert have[key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), key
