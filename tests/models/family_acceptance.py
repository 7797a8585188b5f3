"""The acceptance checks of a model family against transformers, shared by the per-family test
files: a tiny random checkpoint saved with the quickstart tokenizer, the HF -> miles -> HF weight
round trip, the engine's greedy tokens and log-probs, the refusal of ``--true-on-policy``, one GRPO
step through the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles_host.models import load_pretrained, save_pretrained
from miles_host.quickstart_preset import QUICKSTART_DIR

#: the quickstart tokenizer's vocabulary, so that a GRPO step can run on the same checkpoint
VOCAB = 99
PROMPTS = [[5, 9, 17, 33, 2], list(range(10, 31)), [7] * 9, [90, 3]]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def save_tiny(model_type: str, config: dict, path: Path):
    """A random transformers model of ``model_type`` (float32, eval) saved at ``path`` with the
    quickstart tokenizer: peaky matrices (no near-ties in greedy choices), perturbed vectors."""
    import transformers

    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.dim() > 1 and not name.endswith("mlp.gate.weight"):
                tensor.normal_(0.0, 0.15)
            elif tensor.dim() == 1 and tensor.dtype.is_floating_point:
                tensor.add_(torch.randn_like(tensor) * 0.1)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(QUICKSTART_DIR / "model" / name, path / name)
    return model


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def assert_round_trip_bit_for_bit(path: Path, lookup, out: Path) -> None:
    """Load the checkpoint, save it again: the same tensor names, dtypes and bits."""
    save_pretrained(load_pretrained(path, family=lookup), out, family=lookup)
    saved, original = _tensors(out), _tensors(path)
    assert sorted(saved) == sorted(original)
    for name, tensor in original.items():
        assert saved[name].dtype == tensor.dtype and torch.equal(saved[name], tensor), name


def assert_engine_matches_transformers(hf_model, model, max_new_tokens: int = 10, atol: float = 1e-5, **engine_kwargs):
    """The engine's greedy tokens equal transformers' greedy generate; its log-probs at
    temperature 0.7 equal transformers' ``log_softmax(logits / 0.7)``. Returns the engine."""
    from miles_host.rollout import Engine

    from tests.rollout.conftest import engine_logprobs, hf_logprobs
    from tests.rollout.test_correctness import hf_greedy

    engine = Engine(model, **({"kv_cache_tokens": 512, "block_size": 4} | engine_kwargs))
    greedy = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    outputs = engine.generate(PROMPTS, greedy)
    assert [o["output_ids"] for o in outputs] == hf_greedy(hf_model, PROMPTS, max_new_tokens)
    sampled = engine.generate(PROMPTS, {**greedy, "temperature": 0.7, "sampling_seed": 1})
    for prompt, output in zip(PROMPTS, sampled):
        reference = hf_logprobs(hf_model, prompt, output["output_ids"], 0.7)
        assert (engine_logprobs(output) - reference).abs().max() <= atol
    return engine


def assert_small_cache_engine_matches(model) -> None:
    """n=2 samples per prompt (prefix sharing) through a cache so small that sequences are
    preempted and recomputed, prompts prefilled in chunks: the tokens of a roomy engine, and
    its log-probs up to batch-composition rounding."""
    from miles_host.rollout import Engine

    params = {"temperature": 0.8, "max_new_tokens": 24, "ignore_eos": True, "n": 2, "sampling_seed": 5}
    expected = Engine(model, kv_cache_tokens=1024, block_size=4).generate(PROMPTS, params)
    small = Engine(model, kv_cache_tokens=96, block_size=4, max_num_batched_tokens=16)
    got = small.generate(PROMPTS, params)
    assert small.scheduler.num_preemptions > 0
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    for a, b in zip(got, expected):
        pairs = zip(a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"])
        assert max(abs(x[0] - y[0]) for x, y in pairs) <= 1e-4


def assert_gpu_engine_matches_transformers(hf_model, model) -> None:
    """On CUDA (float32, Triton attention, decode in CUDA graphs): as :func:`assert_engine_matches_transformers`."""
    engine = assert_engine_matches_transformers(
        hf_model, model.cuda(), atol=1e-4, kv_cache_tokens=None, max_num_seqs=8, mem_fraction_static=0.3,
        max_kv_cache_tokens=4096,
    )
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0


def assert_true_on_policy_refused(model) -> None:
    """A forward in batch-invariant mode (``--true-on-policy``) raises with the reason."""
    from miles_host.models import ForwardContext, PackedAttention

    ctx = ForwardContext(attention=PackedAttention(torch.tensor([0, 3])), batch_invariant=True)
    with pytest.raises(ValueError, match="does not support --true-on-policy"), torch.no_grad():
        model.forward_hidden(torch.tensor([5, 6, 7]), torch.arange(3), ctx)


def grpo_step(path: Path, workdir: Path) -> dict:
    """One GRPO step (2 prompts x 2 samples, 4 new tokens) of the checkpoint through ``miles run``
    on the CPU; returns the step's training metrics."""
    from miles_host.cli.main import main

    data = workdir / "data.jsonl"
    data.write_text("".join(json.dumps({"input": p, "label": a}) + "\n" for p, a in [("7+5=", "12"), ("3+44=", "47")]))
    args = [
        "run", "--hf-checkpoint", str(path), "--prompt-data", str(data), "--input-key", "input",
        "--label-key", "label", "--rm-type", "exact", "--advantage-estimator", "grpo", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--num-rollout", "1", "--lr", "1e-3",
        "--device", "cpu", "--dtype", "float32", "--output-dir", str(workdir / "out"), "--no-progress",
    ]
    assert main(args) == 0
    rows = [json.loads(line) for line in (workdir / "out" / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "train/train_rollout_logprob_abs_diff" in row]
    assert len(trained) == 1
    return trained[0]
