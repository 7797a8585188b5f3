"""Collectives of the host's process groups on payloads the backends do not type."""

from __future__ import annotations

import torch

from miles_host.distributed.comm import broadcast_, free_port, new_group


def test_fp8_tensors_broadcast_as_bytes_over_gloo():
    group = new_group("127.0.0.1", free_port(), 0, 1, "gloo", 30.0)
    weights = torch.randn(4, 8).to(torch.float8_e4m3fn)
    before = weights.view(torch.uint8).clone()
    assert broadcast_(group, weights, 0) is weights  # gloo alone raises "Invalid scalar type"
    assert weights.dtype == torch.float8_e4m3fn and torch.equal(weights.view(torch.uint8), before)
    floats = torch.randn(3)
    assert torch.equal(broadcast_(group, floats.clone(), 0), floats)
