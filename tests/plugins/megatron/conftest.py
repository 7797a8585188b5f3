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
