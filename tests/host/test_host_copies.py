"""``host_to_device`` / ``host_values``: a packed batch's host-built tensors reach the GPU without
a host sync, and their host values are read back without one."""

from __future__ import annotations

import pytest
import torch

from miles_host.devices import host_to_device, host_values


def test_on_the_cpu_a_tensor_is_its_own_host_copy():
    values = torch.arange(5)
    assert host_to_device(values, "cpu") is values
    assert host_values(values) is values


def _packed_batch(device: str):
    from miles_host.sample import Sample
    from miles_host.trainer import PackedBatch

    samples = [Sample(prompt="", tokens=[1, 2, 3, 4], response_length=2),
               Sample(prompt="", tokens=[5, 6, 7], response_length=1)]
    return PackedBatch.from_samples(samples, torch.device(device))


def test_a_packed_batch_on_the_cpu():
    batch = _packed_batch("cpu")
    assert batch.cu_seqlens.tolist() == [0, 4, 7]
    assert host_values(batch.positions_T).tolist() == [0, 1, 2, 3, 0, 1, 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_packed_batch_reaches_the_gpu_and_reads_back_without_a_sync():
    torch.cuda.set_sync_debug_mode("error")  # any host sync raises
    try:
        batch = _packed_batch("cuda")
        bounds = host_values(batch.cu_seqlens)
        assert bounds.device.type == "cpu" and bounds.tolist() == [0, 4, 7]
        assert int(host_values(batch.positions_T).max()) == 3
        from miles_host.algorithms.masked_ops import sequence_index
        from miles_host.models import PackedAttention

        assert PackedAttention(batch.cu_seqlens).lengths == [4, 3]
        index = sequence_index(batch.response_lengths, batch.cu_seqlens.device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert index.tolist() == [0, 0, 1]
    assert batch.input_ids_T.tolist() == [1, 2, 3, 4, 5, 6, 7]
    ones = torch.ones(3)
    assert host_values(host_to_device(ones, "cuda", keep_host=True)) is ones
    assert host_values(host_to_device(ones, "cuda")) is not ones  # (not kept: read from the device)
    assert host_values(host_to_device(ones, "cuda", keep_host=True) * 2).tolist() == [2.0, 2.0, 2.0]
