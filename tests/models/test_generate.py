"""Greedy generation over the contiguous KV cache equals transformers' greedy generate."""

from __future__ import annotations

import pytest
import torch

from miles_host.models import ContiguousKVCache, ForwardContext, PackedAttention, greedy_generate, load_pretrained

from .conftest import family_lookup

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 33, 9, 100, 64, 3], [77, 8, 12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


@pytest.mark.parametrize("case", ["llama", "qwen3_moe", "gemma2", "deepseek_v3"])
def test_greedy_generation_matches_transformers(case, checkpoints):
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[case], attn_implementation="eager").eval()
    model = load_pretrained(checkpoints[case], family=family_lookup)
    ours = greedy_generate(model, PROMPTS, max_new_tokens=8, eos_token_id=None)
    for prompt, generated in zip(PROMPTS, ours):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=8, do_sample=False, pad_token_id=0,
            )
        expected = out[0, len(prompt):].tolist()  # transformers stops after eos (id 2)
        assert generated[: len(expected)] == expected


def test_cache_steps_equal_packed_prefill(checkpoints):
    """Token-by-token decoding through the cache gives the prefill's hidden states."""
    model = load_pretrained(checkpoints["gemma3_text"], family=family_lookup)
    tokens = torch.tensor(PROMPTS[2])
    with torch.no_grad():
        cu = torch.tensor([0, len(tokens)], dtype=torch.int32)
        prefill = model.forward_hidden(tokens, torch.arange(len(tokens)), ForwardContext(PackedAttention(cu)))
        cache = ContiguousKVCache()
        ctx = ForwardContext(attention=cache)
        steps = []
        for split in ([0, 4], [4, 5], [5, 6], [6, 11]):
            cache.set_batch(["s"], [split[1] - split[0]])
            steps.append(model.forward_hidden(tokens[split[0]:split[1]], cache.positions(), ctx))
            cache.commit()
    torch.testing.assert_close(torch.cat(steps), prefill, atol=1e-5, rtol=1e-5)


def test_left_and_right_padding_give_the_same_logits(checkpoints):
    model = load_pretrained(checkpoints["qwen2"], family=family_lookup)
    right = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    right_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    left = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
    left_mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    with torch.no_grad():
        a, b = model(right, right_mask), model(left, left_mask)
    torch.testing.assert_close(a[1, :2], b[1, 2:])
    torch.testing.assert_close(a[0], b[0])


def test_attention_layout(checkpoints):
    assert load_pretrained(checkpoints["gemma2"], family=family_lookup).attention_layout() == [
        (2, 16, 16, 4), (2, 16, 16, None)
    ]
    assert load_pretrained(checkpoints["deepseek_v3"], family=family_lookup).attention_layout() == [(4, 24, 12, None)] * 2
