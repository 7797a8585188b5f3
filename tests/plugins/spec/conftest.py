"""Tiny random transformers models for the speculative-decoding tests."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.conftest import _common

transformers = pytest.importorskip("transformers")


def _save(config, tmp_path_factory, name: str, seed: int = 0, scale: float = 0.15):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # peaky logits: greedy comparisons meet no near-ties
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, scale)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return model, str(path)


@pytest.fixture(scope="session")
def policy(tmp_path_factory):
    """(transformers model, path) of a hidden-64, 2-layer Qwen3 with vocabulary 128."""
    return _save(transformers.Qwen3Config(**_common()), tmp_path_factory, "spec_policy")


@pytest.fixture(scope="session")
def bad_draft(policy, tmp_path_factory):
    """The policy with noisy weights: a draft that is often wrong, so rejections happen."""
    hf_model, _ = policy
    draft = transformers.AutoModelForCausalLM.from_config(hf_model.config).float().eval()
    draft.load_state_dict(hf_model.state_dict())
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in draft.parameters():
            if parameter.dim() > 1:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.12)
    path = tmp_path_factory.mktemp("spec_bad_draft")
    draft.save_pretrained(path)
    return draft, str(path)


@pytest.fixture(scope="session")
def moe_policy(tmp_path_factory):
    config = transformers.Qwen3MoeConfig(
        **_common(), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    )
    return _save(config, tmp_path_factory, "spec_moe")


def load(path: str, routing_hooks=None):
    from miles_host.models import load_pretrained

    return load_pretrained(path, dtype=torch.float32, device="cpu", routing_hooks=routing_hooks)


def spec_engine(path: str, *, draft_path: str | None = None, num_steps: int = 3, routing_hooks=None,
                token_map=None, **kwargs):
    """An engine running the eagle strategy: MTP head (fresh, seeded) or a separate draft model
    (``token_map``: FR-Spec ids the draft may propose)."""
    from miles_host.rollout import Engine
    from miles_spec.draft import MTPDraft, ModelDraft, attach_mtp
    from miles_spec.strategy import EagleStrategy

    def factory(engine):
        if draft_path is not None:
            draft = ModelDraft(load(draft_path), engine.model.config.vocab_size, token_map)
            return EagleStrategy(engine, draft, num_steps)
        torch.manual_seed(1)
        attach_mtp(engine.model)
        return EagleStrategy(engine, MTPDraft(engine.model, token_map), num_steps)

    kwargs.setdefault("kv_cache_tokens", 4096)
    return Engine(load(path, routing_hooks), decoding_strategy=factory, **kwargs)


def plain_engine(path: str, routing_hooks=None, **kwargs):
    from miles_host.rollout import Engine

    kwargs.setdefault("kv_cache_tokens", 4096)
    return Engine(load(path, routing_hooks), **kwargs)


from tests.loop.conftest import tiny_task  # noqa: E402,F401 - the loop tests' tiny task fixture
