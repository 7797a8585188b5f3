"""Tiny random checkpoints of the model families added beside the conftest's table (saved once
per session with the quickstart tokenizer, :func:`tiny_checkpoint`) and the acceptance checks
against transformers that ``test_family_acceptance.py`` runs for each: the HF -> miles -> HF
weight round trip, the engine's greedy tokens and log-probs, the refusal of ``--true-on-policy``,
preemption, one GRPO step through the CLI. The per-family files test the quirks."""

from __future__ import annotations

import importlib
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
SLIDING, FULL = "sliding_attention", "full_attention"
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, max_position_embeddings=256, initializer_range=0.05,
    pad_token_id=0, bos_token_id=None, eos_token_id=1,
)

#: case -> (HF model_type, config kwargs, family module)
CASES = {
    # DSA: the indexer keeps 4 keys, contexts reach 31 tokens
    "deepseek_v32": ("deepseek_v32", dict(
        _COMMON, intermediate_size=96, num_hidden_layers=2, num_key_value_heads=4, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_group=4, topk_group=2,
        index_n_heads=16, index_head_dim=16, index_topk=4,
    ), "miles_models.deepseek_v32"),
    # sliding and full layers, one KV-sharing layer of each, sparse activations on two layers,
    # per-layer MLP widths, per-layer-input ids past their table
    "gemma3n": ("gemma3n_text", dict(
        _COMMON, intermediate_size=[96, 80, 96, 64, 96], num_hidden_layers=5, num_key_value_heads=2, head_dim=16,
        layer_types=[SLIDING, FULL, SLIDING, FULL, SLIDING], sliding_window=4, num_kv_shared_layers=2,
        activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0, 0.0], altup_num_inputs=4, laurel_rank=8,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=64, final_logit_softcapping=30.0,
    ), "miles_models.gemma3n"),
}
_SAVED: dict[str, tuple] = {}


def family_lookup(case: str):
    """The ``family`` argument of :func:`load_pretrained` for a case: its plugin's record."""
    module = importlib.import_module(CASES[case][2])
    (record,) = module.miles_register_model_families()

    def lookup(model_type: str):
        assert model_type in record.model_types, model_type
        return record

    return lookup


def tiny_checkpoint(case: str, tmp_path_factory) -> tuple:
    """``(transformers model, checkpoint path)`` of a case, built once per session."""
    if case not in _SAVED:
        model_type, config, _ = CASES[case]
        path = tmp_path_factory.mktemp(case)
        _SAVED[case] = save_tiny(model_type, config, path), path
    return _SAVED[case]


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
