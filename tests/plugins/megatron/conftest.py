"""Fixtures shared by the megatron tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_rank_group():
    """The megatron trainer creates a one-rank process group and Megatron's parallel state
    (gloo on CPU, NCCL on GPU); a module using this fixture leaves none behind."""
    import torch.distributed as dist

    existed = dist.is_initialized()
    yield
    from megatron.core import parallel_state

    if not existed and dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def save_models(root, makers: dict, prepare=None):
    """Random HF checkpoints of ``{name: config factory}`` under ``root`` (seed 0; ``prepare(model)``
    may change the weights first) and a small addition dataset: ``(paths by name, data path)``."""
    import torch
    import transformers

    from tests.loop.conftest import write_addition_data

    paths = {}
    for name, make in makers.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(make())
        if prepare is not None:
            prepare(model)
        model.save_pretrained(root / name)
        paths[name] = root / name
    return paths, write_addition_data(root / "data.jsonl", 8)


def transformers_log_probs(path, samples):
    """Log-probs of each sample's response tokens under transformers' own model of ``path``
    (float32, eager attention): the reference the megatron backend's log-probs are held to."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    out = []
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor(sample.tokens)
            start = len(ids) - sample.response_length
            logits = model.eval()(ids[None]).logits[0, start - 1 : -1].float()
            out.append(torch.log_softmax(logits, dim=-1).gather(1, ids[start:, None])[:, 0])
    return torch.cat(out)


def assert_log_probs_equal_transformers(models, name: str, tolerance: float = 1e-5) -> None:
    """The megatron backend's log-probs of ``models[name]`` are transformers' within ``tolerance``."""
    from tests.plugins.megatron.test_megatron_trainer import log_probs, make_samples, make_trainer

    trainer = make_trainer(models, name, "megatron")
    samples = make_samples()
    expected = transformers_log_probs(models[0][name], samples)
    got = log_probs(trainer, samples)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() < tolerance
