"""Weight sync from a sharded megatron trainer, bucket by bucket (``miles_megatron.weight_buckets``).

A TP2 x PP2 trainer group (four gloo ranks on CPU; PP2 in the default run) trains two steps, then streams its
weights to an engine in buckets of ``--update-weight-buffer-size`` bytes: the engine ends
with the one-process trainer's weights, and no bucket is larger than the buffer (except
a single tensor larger than it, alone in its bucket).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytest.importorskip("transformers")

from tests.plugins.megatron.test_megatron_parallel import FLAGS, WEIGHT_TOL, _one_process_run, clean_groups  # noqa: E402,F401
from tests.plugins.megatron.test_megatron_trainer import make_samples, make_trainer, models  # noqa: E402,F401

#: small enough to cut the tiny model into many buckets (its largest tensor, the MLP's gate/up, is 48 KiB)
BUCKET_BYTES = 64 << 10


class RecordingEngine:
    """An engine's ``update_weights``: keeps the weights and the size of each update."""

    def __init__(self):
        self.weights: dict[str, torch.Tensor] = {}
        self.updates: list[tuple[int, int]] = []  # (bytes, tensors)
        self.version = None

    def update_weights(self, named_tensors, weight_version=None):
        named = list(named_tensors)
        self.updates.append((sum(t.numel() * t.element_size() for _, t in named), len(named)))
        self.weights.update({name: tensor.detach().clone() for name, tensor in named})
        self.version = weight_version
        return weight_version


@pytest.mark.parametrize("tp,pp", [
    # the second stage's source sends its buckets to rank 0
    pytest.param(1, 2, id="pp2"),
    # four ranks: each stage's buckets TP-gathered (vocabulary, heads, the gated MLP halves) before they are sent
    pytest.param(2, 2, id="tp2_pp2", marks=pytest.mark.slow),
    pytest.param(2, 1, id="tp2", marks=pytest.mark.slow),
])
def test_sharded_trainer_streams_the_one_process_weights_in_bounded_buckets(models, clean_groups, tp, pp):
    from miles_host.weight_sync import InProcessTransport

    samples = make_samples()
    _, _, expected, _ = _one_process_run(models, "qwen3", samples)
    group = make_trainer(models, "qwen3", "megatron", *FLAGS, "--tensor-model-parallel-size", str(tp),
                         "--pipeline-model-parallel-size", str(pp), "--actor-num-gpus-per-node", str(tp * pp),
                         "--update-weight-buffer-size", str(BUCKET_BYTES))
    try:
        assert group.streams_weights
        for _ in range(2):
            group.train(samples)
        engine, transport = RecordingEngine(), InProcessTransport(group.config)
        for bucket in group.weight_buckets(int(group.config.update_weight_buffer_size)):
            transport.push(bucket, engine, 3)
        assert engine.version == 3 and engine.weights.keys() == expected.keys()
        assert max(float((engine.weights[k].float() - expected[k].float()).abs().max()) for k in expected) < WEIGHT_TOL
        largest = max(t.numel() * t.element_size() for t in expected.values())
        assert largest < BUCKET_BYTES and len(engine.updates) > 4
        assert all(nbytes <= BUCKET_BYTES for nbytes, _ in engine.updates), engine.updates
        group.rank_counters()  # every rank left the collective and answers
    finally:
        group.stop()
