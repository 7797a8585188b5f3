"""--log-probs-chunk-size reaches the trainer's log-prob pass, and the values do not depend on it."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from miles_host.config import MilesConfig
from miles_host.models.logprobs import chunked_log_probs
from miles_host.routing import RoutingContext
from miles_host.trainer import NativeTrainer


class Model:
    """A stand-in model: records the keyword arguments, computes chunked log-probs of fixed
    hidden states (so chunking is exercised for real)."""

    def __init__(self):
        torch.manual_seed(0)
        self.hidden = torch.randn(7, 8, dtype=torch.float64)
        self.head = torch.randn(11, 8, dtype=torch.float64)
        self.calls = []

    def packed_log_probs(self, input_ids, positions, cu_seqlens, targets, **kwargs):
        self.calls.append(kwargs)
        return chunked_log_probs(self.hidden, self.head, targets, temperature=kwargs["temperature"],
                                 chunk_size=kwargs.get("chunk_size", 1024), return_entropy=False)


def _log_probs(chunk_size):
    trainer = SimpleNamespace(config=MilesConfig(log_probs_chunk_size=chunk_size),
                              _true_on_policy_dtype=lambda model: None, _autocast=contextlib.nullcontext)
    batch = SimpleNamespace(cu_seqlens=torch.tensor([0, 7], dtype=torch.int32), routing=RoutingContext(),
                            input_ids_T=torch.zeros(7, dtype=torch.long), positions_T=torch.arange(7),
                            target_ids_T=torch.tensor([1, 4, 2, 9, 0, 10, 3]), response_index_R=torch.arange(2, 7))
    model = Model()
    log_probs, _ = NativeTrainer.response_log_probs(trainer, model, batch)
    return log_probs, model.calls[0]


@pytest.mark.parametrize("chunk_size", [1, 3])
def test_chunk_size_reaches_the_model_and_keeps_the_values(chunk_size):
    chunked, kwargs = _log_probs(chunk_size)
    assert kwargs["chunk_size"] == chunk_size
    whole, default_kwargs = _log_probs(-1)
    assert "chunk_size" not in default_kwargs
    model = Model()
    reference = torch.log_softmax(model.hidden @ model.head.T, -1)[torch.arange(7), _targets()][2:]
    torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(chunked.double(), reference)


def _targets():
    return torch.tensor([1, 4, 2, 9, 0, 10, 3])


@pytest.mark.parametrize("value", [0, -2])
def test_values_that_mean_nothing(value):
    with pytest.raises(ValueError, match="--log-probs-chunk-size"):
        MilesConfig(log_probs_chunk_size=value)
