"""Built-in plugin: weight-sync transports (in-process, disk)."""

from __future__ import annotations

from miles_host.records import WeightSyncTransport


def _inprocess(config):
    from miles_host.weight_sync import InProcessTransport

    return InProcessTransport(config)


def _disk(config):
    from miles_host.weight_sync import DiskTransport

    return DiskTransport(config)


def miles_register_weight_sync_transports():
    """Transports of the host."""
    return [
        WeightSyncTransport("inprocess", "same process: tensors handed over, no copy through disk", factory=_inprocess,
                            in_process_only=True),
        WeightSyncTransport("disk", "safetensors files in the output directory (fallback)", factory=_disk),
    ]
