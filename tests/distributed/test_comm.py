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


def _listening_addresses(port: int) -> list[str]:
    """Local addresses of the sockets listening on ``port`` (Linux /proc/net)."""
    listening = "0A"
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as handle:
            for line in handle.readlines()[1:]:
                local, _, state = line.split()[1:4]
                address, hex_port = local.split(":")
                if state == listening and int(hex_port, 16) == port:
                    found.append(address)
    return found


def test_the_store_of_a_one_node_group_listens_on_loopback_only():
    import datetime
    import sys

    import pytest

    from miles_host.distributed.comm import loopback_ip, tcp_store

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/net/tcp")
    port = free_port()
    master = tcp_store("127.0.0.1", port, 2, True, datetime.timedelta(seconds=30))
    worker = tcp_store("127.0.0.1", port, 2, False, datetime.timedelta(seconds=30))
    worker.set("rank1", "here")
    assert master.get("rank1") == b"here"
    # 0100007F is 127.0.0.1 in /proc's byte order; torch's own server would listen on 0.0.0.0 / ::
    assert _listening_addresses(port) == ["0100007F"]
    one = free_port()
    group = new_group("127.0.0.1", one, 0, 1, "gloo", 30.0)
    assert _listening_addresses(one) == ["0100007F"]
    del group
    assert loopback_ip("localhost") == "127.0.0.1" and loopback_ip("10.1.2.3") is None
