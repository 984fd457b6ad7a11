"""Reading an offline W&B run back: the records of its ``run-<id>.wandb`` file.

The file is W&B's transaction log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0) and then LevelDB's log
format (32 KiB blocks of records, each a CRC-32 of type + data, a length and a type: full, first, middle, last),
each record's data a ``wandb.proto.wandb_internal_pb2.Record``. wandb itself no longer ships a Python reader, so
the framing is read here (about twenty lines) and every record is parsed with wandb's own protobuf classes.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any, Iterator

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def chunks(path: Path) -> Iterator[bytes]:
    """Each record's data, checksums checked."""
    data = Path(path).read_bytes()
    assert data[:len(HEADER)] == HEADER, f"{path} is not a W&B transaction log (header {data[:7]!r})"
    pos, pending = len(HEADER), b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding at the end of a block being written
            break
        body = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"bad checksum at byte {pos}"
        pos += 7 + length
        if kind == FULL:
            yield body
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        elif kind == LAST:
            yield pending + body


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    out = []
    for body in chunks(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(body)
        out.append(record)
    return out


def run_file(folder: Path) -> Path:
    """The ``run-<id>.wandb`` file of an ``offline-run-*`` folder."""
    (found,) = Path(folder).glob("run-*.wandb")
    return found


def history(folder: Path) -> dict[int, dict[str, Any]]:
    """``_step`` -> the logged values (W&B's own ``_runtime`` / ``_timestamp`` / ``_step`` left out)."""
    rows: dict[int, dict[str, Any]] = {}
    for record in records(run_file(folder)):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        rows[row["_step"]] = {k: v for k, v in row.items() if not k.startswith("_")}
    return rows


def run_record(folder: Path) -> Any:
    """The run's own record: id, project, display name and the config given to ``wandb.init``."""
    return next(r.run for r in records(run_file(folder)) if r.WhichOneof("record_type") == "run")


def config_of(run: Any) -> dict[str, Any]:
    return {item.key: json.loads(item.value_json) for item in run.config.update if not item.key.startswith("_")}
