"""Tiny random transformers models (dense Qwen3, Llama, MoE Qwen3), saved once per session.

Each fixture yields ``(hf_model, path)``: the transformers model is the reference,
``path`` is loaded through :func:`miles_host.models.load_pretrained` by the tests.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 128


def _save(config, tmp_path_factory, name: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    # Peakier logits than the default init: greedy comparisons meet no near-ties.
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.15)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return model, str(path)


def _common():
    return dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        eos_token_id=VOCAB - 1, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
    )


@pytest.fixture(scope="session")
def qwen3_dense(tmp_path_factory):
    return _save(transformers.Qwen3Config(**_common()), tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def llama_dense(tmp_path_factory):
    return _save(transformers.LlamaConfig(**_common()), tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def qwen3_moe(tmp_path_factory):
    config = transformers.Qwen3MoeConfig(
        **_common(), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    )
    return _save(config, tmp_path_factory, "qwen3_moe")


def load(path: str, routing_hooks=None):
    """The miles model of a saved checkpoint, float32 on CPU."""
    from miles_host.models import load_pretrained

    return load_pretrained(path, dtype=torch.float32, device="cpu", routing_hooks=routing_hooks)


def make_engine(path: str, routing_hooks=None, **kwargs):
    from miles_host.rollout import Engine

    kwargs.setdefault("kv_cache_tokens", 2048)
    return Engine(load(path, routing_hooks), **kwargs)


def hf_logprobs(hf_model, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of the transformers model at each output token."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = hf_model(ids).logits[0].float()
    steps = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return torch.log_softmax(logits[steps] / temperature, dim=-1)[torch.arange(len(output)), torch.tensor(output)]


def engine_logprobs(output: dict) -> torch.Tensor:
    entries = output["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == output["output_ids"]
    return torch.tensor([e[0] for e in entries])


def assert_same_outputs(got: list[dict], expected: list[dict], atol: float) -> None:
    """Two engines' outputs: the same tokens, log-probs within ``atol``."""
    for a, b in zip(got, expected, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert (engine_logprobs(a) - engine_logprobs(b)).abs().max() <= atol


PROMPTS = [[5, 9, 17, 33, 2], list(range(10, 41)), [7] * 19, [100, 3]]
