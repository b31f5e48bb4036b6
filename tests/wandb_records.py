"""Read back what an offline W&B run logged, from its run-*.wandb file (for tests).

The file is W&B's record log: a 7-byte header (":W&B", a 2-byte magic, a version byte), then
LevelDB-log-format records in 32 KiB blocks (4-byte CRC, 2-byte little-endian length, 1-byte type:
1 full, 2 first, 3 middle, 4 last), each payload a ``wandb_internal_pb2.Record`` protobuf.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7


def _payloads(data: bytes):
    pos, pending = HEADER, b""
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:
            pos += room  # block trailer padding
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""


def history(run_folder: str | Path) -> list[dict]:
    """Every history row (``run.log`` call) of an offline run folder, with its ``_step``."""
    from wandb.proto import wandb_internal_pb2

    (path,) = Path(run_folder).glob("run-*.wandb")
    rows = []
    for payload in _payloads(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows
