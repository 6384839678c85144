"""Reading back an offline Weights & Biases run: its ``run-<id>.wandb`` file holds protobuf records
(``wandb.proto.wandb_internal_pb2.Record``) in LevelDB's log format after a 7-byte header: 32 KiB
blocks of chunks, each ``crc32 (4) | length (2, little-endian) | type (1: full, 2: first, 3: middle,
4: last)`` then its bytes."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B datastore"
    out, pending, pos = [], b"", HEADER
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:  # the block's tail is padding
            pos += room
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            pos += BLOCK - pos % BLOCK if pos % BLOCK else 0
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def history(path: Path) -> list[dict[str, Any]]:
    """Each logged step's values (``_step`` included)."""
    rows = []
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return rows


def config(path: Path) -> dict[str, Any]:
    """The run's config, as its run and config records set it."""
    out: dict[str, Any] = {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        updates = r.config.update if kind == "config" else r.run.config.update if kind == "run" else []
        for item in updates:
            value = json.loads(item.value_json)
            out[item.key or "/".join(item.nested_key)] = value.get("value", value) if isinstance(value, dict) else value
    return out
