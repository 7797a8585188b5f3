"""``--plugins fp8`` through the host loop: trainer and engine swap, sync, train, sync again."""

from __future__ import annotations

import math

import pytest
import torch

from miles_fp8.linear import Fp8InferenceLinear, Fp8Linear
from miles_host.cli.args import resolve_run_config
from miles_host.loop import Run
from miles_host.plugin_manager import MilesPluginManager
from tests.loop.conftest import write_addition_data

from .conftest import _common

transformers = pytest.importorskip("transformers")


def length_reward(sample, config):
    """Reward with variance inside every group."""
    return float(len(sample.response)) + 0.1 * (sample.index % 3)


def _char_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate("0123456789+=")}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>")


def test_fp8_run_step(tmp_path):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**{**_common(), "vocab_size": 14, "eos_token_id": 1, "pad_token_id": 0})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    _char_tokenizer().save_pretrained(tmp_path / "model")
    data = write_addition_data(tmp_path / "data.jsonl", 8)
    manager = MilesPluginManager()
    manager.discover()
    argv = [
        "--hf-checkpoint", str(tmp_path / "model"), "--prompt-data", str(data), "--label-key", "label",
        "--custom-rm-path", f"{__name__}.length_reward", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "6", "--num-rollout", "1", "--micro-batch-size", "2", "--lr", "1e-3",
        "--dtype", "float32", "--device", "cpu", "--output-dir", str(tmp_path / "out"), "--no-progress",
        "--plugins", "fp8",
    ]
    run_config, _ = resolve_run_config(argv, manager)
    assert run_config.precision == "fp8"
    run = Run(run_config, manager)
    assert isinstance(run.trainer.model.layers[0].attn.qkv_proj, Fp8Linear)
    assert isinstance(run.backend.engine.model.layers[0].attn.qkv_proj, Fp8InferenceLinear)
    run.sync_weights(version=run.state.weight_version)
    groups, _ = run.rollout.generate(0)
    metrics = run.trainer.train([s for g in groups for s in g])
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))
    # unified: the recomputed log-probs match the rollout's up to the decode-vs-packed path
    assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-3
    run.sync_weights()
    trained = run.trainer.model.layers[0].attn.qkv_proj.weight
    synced = run.backend.engine.model.layers[0].attn.qkv_proj
    from miles_fp8.quant import quantize_weight

    q, scale = quantize_weight(trained.detach())
    assert torch.equal(synced.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(synced.weight_scale_inv, scale)
