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
