"""Reading a wandb offline run file (``run-<id>.wandb``) with wandb's own protobuf messages.

The file is wandb's LevelDB-log framing: a 7-byte header (``:W&B``, magic 0xBEE1, version),
then 32 KiB blocks of records ``crc32 (uint32) | length (uint16) | type (uint8) | data``, a
record split over blocks as FIRST, MIDDLE..., LAST parts; the crc of a part is zlib's crc32 of
its data seeded with the crc32 of its type byte. Each whole record is a
``wandb.proto.wandb_internal_pb2.Record``. (wandb's Python reader,
``wandb.sdk.internal.datastore``, left the package when its service moved to Go.)
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
TYPE_CRC = {kind: zlib.crc32(bytes([kind])) & 0xFFFFFFFF for kind in (FULL, FIRST, MIDDLE, LAST)}


def record_payloads(path: Path) -> list[bytes]:
    """The whole records' bytes, in order; ValueError on a bad header or checksum."""
    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:HEADER])
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError(f"{path} is not a wandb run file (header {data[:HEADER]!r})")
    payloads, pending, position = [], b"", HEADER
    while position + HEADER <= len(data):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < HEADER:  # the block's trailer: zeros
            position += left_in_block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[position : position + HEADER])
        if kind == 0 and length == 0:  # zero padding up to the block's end
            position += left_in_block
            continue
        body = data[position + HEADER : position + HEADER + length]
        if len(body) < length:  # the writer is still at it
            break
        if zlib.crc32(body, TYPE_CRC[kind]) & 0xFFFFFFFF != checksum:
            raise ValueError(f"{path}: bad checksum of the record at byte {position}")
        position += HEADER + length
        if kind == FULL:
            payloads.append(body)
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        else:
            payloads.append(pending + body)
            pending = b""
    return payloads


def records(path: Path) -> list:
    """The file's ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    out = []
    for payload in record_payloads(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        out.append(record)
    return out


def history_rows(run_dir: Path, timeout_s: float = 60.0) -> list[dict]:
    """The rows ``wandb.log`` wrote to the offline run in ``run_dir`` (key -> decoded value),
    once the run's exit record is on disk (``run.finish()`` returns before wandb's writer,
    a process of its own, has written everything)."""
    (path,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + timeout_s
    while not any(record.WhichOneof("record_type") == "exit" for record in records(path)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} has no exit record after {timeout_s:.0f}s")
        time.sleep(0.2)
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows
