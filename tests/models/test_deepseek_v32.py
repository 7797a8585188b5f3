"""DeepSeek-V3.2 (``deepseek_v32``, DeepSeek Sparse Attention) against transformers on a tiny
random model whose indexer keeps 4 keys of contexts up to 29 tokens: training logits, the
engine's greedy tokens and log-probs, the HF -> miles -> HF weight round trip, a GRPO step,
and the refusal of ``--true-on-policy``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from miles_host.models import ForwardContext, PackedAttention, load_pretrained, save_pretrained
from miles_host.quickstart_preset import QUICKSTART_DIR
from miles_models import deepseek_v32

from .conftest import hf_logits, prompts_batch

transformers = pytest.importorskip("transformers")

RECORD = deepseek_v32.miles_register_model_families()[0]
VOCAB = 99  # the quickstart tokenizer's, so that the GRPO step can run on the same checkpoint
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, max_position_embeddings=256, initializer_range=0.05, pad_token_id=0, bos_token_id=None,
    eos_token_id=1, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=12, n_group=4, topk_group=2, index_n_heads=16, index_head_dim=16, index_topk=4,
    num_nextn_predict_layers=0,
)
PROMPTS = [[5, 9, 17, 33, 2], list(range(10, 31)), [7] * 9, [90, 3]]


def lookup(model_type: str):
    assert model_type == "deepseek_v32"
    return RECORD


def save_hf(path, **overrides):
    config = transformers.AutoConfig.for_model("deepseek_v32", **{**CONFIG, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # peaky weights (no near-ties in greedy choices), perturbed norms and biases
        for name, tensor in model.state_dict().items():
            if tensor.dim() > 1 and "gate.weight" not in name:
                tensor.normal_(0.0, 0.15)
            elif tensor.dim() == 1 and tensor.dtype.is_floating_point:
                tensor.add_(torch.randn_like(tensor) * 0.1)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(QUICKSTART_DIR / "model" / name, path / name)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v32")
    return save_hf(path), path


def test_logits_match_transformers_and_the_top_k_matters(checkpoint, tmp_path):
    _, path = checkpoint
    input_ids, attention_mask = prompts_batch(VOCAB, lengths=(29, 6, 13))
    valid = attention_mask.bool()
    reference = hf_logits(path, input_ids, attention_mask)
    model = load_pretrained(path, family=lookup)
    assert model.config.dsa.index_topk == 4
    with torch.no_grad():
        logits = model(input_ids, attention_mask)
    assert (logits[valid] - reference[valid]).abs().max().item() <= 1e-4
    # the same weights attending densely (top-k above every context) give other logits
    dense = json.loads((path / "config.json").read_text()) | {"index_topk": 64}
    save_pretrained(model, tmp_path, family=lookup)
    (tmp_path / "config.json").write_text(json.dumps(dense))
    assert (hf_logits(tmp_path, input_ids, attention_mask)[valid] - reference[valid]).abs().max().item() > 1e-2


def test_weights_round_trip_bit_for_bit(checkpoint, tmp_path):
    hf_model, path = checkpoint
    model = load_pretrained(path, family=lookup)
    assert any(".indexer." in name for name, _ in model.named_parameters())
    save_pretrained(model, tmp_path, family=lookup)
    saved = {}
    for file in tmp_path.glob("*.safetensors"):
        saved.update(load_file(file))
    original = {}
    for file in path.glob("*.safetensors"):
        original.update(load_file(file))
    assert sorted(saved) == sorted(original)
    for name, tensor in original.items():
        assert saved[name].dtype == tensor.dtype and torch.equal(saved[name], tensor), name


def test_engine_greedy_tokens_and_log_probs_match_transformers(checkpoint):
    from miles_host.rollout import Engine

    from tests.rollout.conftest import engine_logprobs, hf_logprobs
    from tests.rollout.test_correctness import hf_greedy

    hf_model, path = checkpoint
    model = load_pretrained(path, dtype=torch.float32, device="cpu", family=lookup)
    layout = model.attention_layout()
    assert layout[2:] == [(1, 16, 0, None)] * 2  # the indexer keys beside the MLA cache
    engine = Engine(model, kv_cache_tokens=512, block_size=4)
    outputs = engine.generate(PROMPTS, {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True})
    assert [o["output_ids"] for o in outputs] == hf_greedy(hf_model, PROMPTS, 10)
    sampled = engine.generate(
        PROMPTS, {"temperature": 0.7, "max_new_tokens": 10, "ignore_eos": True, "sampling_seed": 1}
    )
    for prompt, output in zip(PROMPTS, sampled):
        reference = hf_logprobs(hf_model, prompt, output["output_ids"], 0.7)
        assert (engine_logprobs(output) - reference).abs().max() <= 1e-5


def test_true_on_policy_is_refused_with_the_reason(checkpoint):
    model = load_pretrained(checkpoint[1], family=lookup)
    tokens = torch.tensor([5, 6, 7])
    ctx = ForwardContext(attention=PackedAttention(torch.tensor([0, 3])), batch_invariant=True)
    with pytest.raises(ValueError, match="does not support --true-on-policy"), torch.no_grad():
        model.forward_hidden(tokens, torch.arange(3), ctx)


@pytest.mark.slow
def test_a_grpo_step_runs(checkpoint, tmp_path):
    from miles_host.cli.main import main

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input": p, "label": a}) + "\n" for p, a in [("7+5=", "12"), ("3+44=", "47")]))
    args = [
        "run", "--hf-checkpoint", str(checkpoint[1]), "--prompt-data", str(data), "--input-key", "input",
        "--label-key", "label", "--rm-type", "exact", "--advantage-estimator", "grpo", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--num-rollout", "1", "--lr", "1e-3",
        "--device", "cpu", "--dtype", "float32", "--output-dir", str(tmp_path / "out"), "--no-progress",
    ]
    assert main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "train/train_rollout_logprob_abs_diff" in row]
    assert len(trained) == 1
    assert trained[0]["train/train_rollout_logprob_abs_diff"] < 1e-4
