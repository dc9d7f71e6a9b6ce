"""Read a W&B offline run back from disk (``run-<id>.wandb``), without W&B's servers.

The ``.wandb`` file is W&B's transaction log: a 7-byte header (``":W&B"``, magic 0xBEE1, version 0)
followed by LevelDB-log-format blocks of 32 KiB; each chunk has a 7-byte header (CRC32C, length,
type FULL/FIRST/MIDDLE/LAST) and the payload is a serialized ``wandb.proto.wandb_internal_pb2.Record``.
Recent wandb releases no longer ship a Python reader, hence this one (used by the tests and by
``titan-ext wandb-offline RUN_DIR``).
"""

import json
import struct
import sys
from pathlib import Path
from typing import Any

__all__ = ["read_records", "read_history", "find_offline_runs", "main"]

_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _chunks(data: bytes):
    if data[:4] != b":W&B":
        raise ValueError("not a W&B transaction log (missing ':W&B' header)")
    pos = 7
    pending = b""
    while pos + 7 <= len(data):
        block_left = _BLOCK - (pos % _BLOCK)
        if block_left < 7:  # block trailer padding
            pos += block_left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            yield payload
        elif kind == _FIRST:
            pending = payload
        elif kind == _MIDDLE:
            pending += payload
        elif kind == _LAST:
            yield pending + payload
            pending = b""
        elif kind == 0 and length == 0:
            continue
        else:
            raise ValueError(f"corrupt W&B log: chunk type {kind} at offset {pos}")


def read_records(path: str | Path):
    """Yield ``wandb_internal_pb2.Record`` objects of one ``.wandb`` file."""
    from wandb.proto import wandb_internal_pb2 as pb

    for payload in _chunks(Path(path).read_bytes()):
        record = pb.Record()
        record.ParseFromString(payload)
        yield record


def read_history(path: str | Path) -> list[dict[str, Any]]:
    """The logged history rows (``wandb.log`` calls), values decoded from JSON."""
    rows = []
    for record in read_records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        rows.append(row)
    return rows


def find_offline_runs(root: str | Path) -> list[Path]:
    """All ``offline-run-*/run-*.wandb`` files under ``root``."""
    return sorted(Path(root).rglob("offline-run-*/run-*.wandb"))


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Every offline run under a folder: its path on stderr, then its history rows, one JSON object a line
    on stdout."""
    import argparse

    p = argparse.ArgumentParser(prog=prog, description="Print the logged history of the W&B offline runs "
                                "(offline-run-*/run-*.wandb) under a folder, one JSON object per line, "
                                "without W&B's servers; each run's path goes to stderr.")
    p.add_argument("root", nargs="?", default=".", help="folder searched for offline runs (e.g. a dump folder)")
    a = p.parse_args(argv)
    runs = find_offline_runs(a.root)
    if not runs:
        print(f"no W&B offline run (offline-run-*/run-*.wandb) under {a.root}", file=sys.stderr)
        return 1
    for f in runs:
        print(f, file=sys.stderr)
        for row in read_history(f):
            print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
