"""Read a W&B offline run back from disk (``run-<id>.wandb``), without W&B's servers.

The ``.wandb`` file is W&B's transaction log, as wandb-core writes it (``core/pkg/leveldb/record.go`` and
``crc.go`` of the wandb repository, used with ``CRCAlgoIEEE`` by its transaction-log store; the Python
``wandb/sdk/internal/datastore.py`` of earlier releases wrote and checked the same bytes -- recent
releases ship no Python reader, hence this one):

* a 7-byte file header: ``":W&B"``, magic 0xBEE1 (uint16, little-endian), version 0;
* then LevelDB log blocks of 32 KiB, counted from the start of the file (the header sits in block 0).
  A block holds chunks: a 7-byte header -- checksum (uint32 LE), payload length (uint16 LE), type (1
  FULL, 2 FIRST, 3 MIDDLE, 4 LAST) -- then the payload. A chunk never crosses a block; the fewer than 7
  bytes left at the end of a block are zeros. A record is one FULL chunk, or FIRST, MIDDLE..., LAST
  (a FIRST may carry no byte); its bytes are a serialized ``wandb_internal_pb2.Record``;
* the checksum is the plain CRC-32 (IEEE, ``zlib.crc32``) of the type byte followed by the payload,
  unmasked -- datastore.py: ``zlib.crc32(data, zlib.crc32(bytes([type])))``, record.go: ``CRCStandard``
  -- not upstream LevelDB's masked CRC-32C, which W&B's writers do not use.

Runs that ended badly stay readable:

* a file cut short (a killed run, a full disk) yields every complete record before the cut, and one
  line on stderr, ``PATH: N records read; the file ends mid-record at byte B`` (exit code 0); a tail of
  zero bytes (space the filesystem gave the file but the run never wrote) is such a cut;
* the first chunk that fails a check (checksum, a length beyond its block, a type out of order, a block
  trailer that is not zeros), or a record that is not a W&B record, stops the reading: the records before
  it are kept and printed, and one line names it by its byte offset, ``error: PATH: the chunk at byte B
  is corrupt (checksum mismatch); N records read before it`` (exit code 2). Reading stops rather than
  skipping ahead, so no value at or after a damaged byte is ever printed;
* a path that is not a regular file (a FIFO, a device, a folder named like a run file) is refused from
  its ``stat``, never opened; a file without the W&B header, or of another version, and an unreadable
  file are refused too (one line, exit code 2).

Reading needs the ``wandb`` package (its record format, ``wandb.proto``), which is optional: without it
``titan-ext wandb-offline`` says ``pip install 'titan-ext[wandb]'`` (exit code 2).

``titan-ext wandb-offline`` prints the history rows as strict JSON, one object a line (a NaN or infinity,
which wandb logs as such, is null; JSON escapes control characters); paths and messages on stderr have
their control characters escaped (:func:`titan_ext.titan.summary.printable`).
"""

import json
import math
import os
import stat
import struct
import sys
import zlib
from pathlib import Path
from typing import Any, NamedTuple

from .summary import InputError, ToolParser, printable

__all__ = ["Log", "read_log", "read_records", "history_row", "read_history", "read_summary", "find_offline_runs",
           "main"]

_BLOCK = 32768
_CHUNK_HEADER = 7
_FILE_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


class Log(NamedTuple):
    records: list[tuple[int, Any]]  # (byte offset of its first chunk, wandb_internal_pb2.Record), in order
    size: int  # bytes in the file
    cut: bool  # the file ends inside a record (or inside its header)
    corrupt: str | None  # why reading stopped before the end ("the chunk at byte B is corrupt (...)")


def _scan(data: bytes) -> tuple[list[tuple[int, bytes]], bool, str | None]:
    """The records of a transaction log (offset, payload), whether the file is cut, what is corrupt."""
    records: list[tuple[int, bytes]] = []
    start, parts = None, []  # the record being assembled: offset of its first chunk, its payloads
    pos, size = len(_FILE_HEADER), len(data)

    while pos < size:
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER:  # the block's trailer
            trailer = data[pos:pos + left]
            if trailer.count(0) != len(trailer):
                return records, False, f"the block trailer at byte {pos} is not zeros"
            pos += left
            continue
        if pos + _CHUNK_HEADER > size:
            return records, True, None
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if crc == length == kind == 0 and data.count(0, pos) == size - pos:
            return records, True, None
        end = pos + _CHUNK_HEADER + length
        if length > left - _CHUNK_HEADER:
            return records, False, f"the chunk at byte {pos} is corrupt (length {length} beyond its block)"
        if end > size:
            return records, True, None
        if zlib.crc32(data[pos + 6:end]) != crc:  # the type byte and the payload
            return records, False, f"the chunk at byte {pos} is corrupt (checksum mismatch)"
        if kind in (_FULL, _FIRST):
            if start is not None:
                return records, False, f"the record at byte {start} is corrupt (no LAST chunk before byte {pos})"
            start, parts = pos, []
        elif kind in (_MIDDLE, _LAST):
            if start is None:
                return records, False, f"the chunk at byte {pos} is corrupt (type {kind} continues no record)"
        else:
            return records, False, f"the chunk at byte {pos} is corrupt (unknown type {kind})"
        parts.append(data[pos + _CHUNK_HEADER:end])
        pos = end
        if kind in (_FULL, _LAST):
            records.append((start, b"".join(parts)))
            start = None
    return records, start is not None, None


def _regular_file_bytes(path: Path) -> bytes:
    """The bytes of a regular file; :class:`InputError` for anything else, which is never opened."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise InputError(f"{printable(str(path))}: not a regular file (a folder, FIFO, device or socket); "
                             "not read")
        # O_NONBLOCK: should a FIFO replace the file after the stat, the read ends at once
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            return f.read()
    except OSError as e:
        raise InputError(f"{printable(str(path))}: {e.strerror or e}") from None


WANDB_INSTALL_HINT = "pip install 'titan-ext[wandb]'"


def _records_module():
    """``wandb_internal_pb2``, W&B's record format; wandb is optional, so a missing one is a
    ``ModuleNotFoundError`` that names the extra to install."""
    try:
        from wandb.proto import wandb_internal_pb2
    except ImportError as e:
        raise ModuleNotFoundError(f"reading W&B runs needs wandb ({e}): {WANDB_INSTALL_HINT}", name="wandb") from None
    return wandb_internal_pb2


def read_log(path: str | Path) -> Log:
    """Every intact record of one ``.wandb`` file up to its end, a cut or the first corrupt chunk (see the
    module docstring); :class:`InputError` for a path that is not a readable W&B transaction log."""
    pb = _records_module()
    from google.protobuf.message import DecodeError  # wandb's dependency

    data = _regular_file_bytes(Path(path))
    if data[:len(_FILE_HEADER)] != _FILE_HEADER:
        if _FILE_HEADER.startswith(data):  # shorter than the header, and right so far
            return Log([], len(data), True, None)
        if data[:4] == _FILE_HEADER[:4] and len(data) >= len(_FILE_HEADER):
            raise InputError(f"{printable(str(path))}: a W&B log of another format (magic and version "
                             f"{data[4:7].hex()}, this reader knows {_FILE_HEADER[4:7].hex()})")
        raise InputError(f"{printable(str(path))}: not a W&B transaction log (no ':W&B' header)")
    payloads, cut, corrupt = _scan(data)
    records = []
    for offset, payload in payloads:
        record = pb.Record()
        try:
            record.ParseFromString(payload)
        except (DecodeError, RecursionError) as e:
            return Log(records, len(data), False, f"the record at byte {offset} is not a W&B record ({e})")
        records.append((offset, record))
    return Log(records, len(data), cut, corrupt)


def read_records(path: str | Path) -> list[Any]:
    """The ``wandb_internal_pb2.Record`` objects of one ``.wandb`` file, up to its end or a cut;
    :class:`InputError` when the file is not a W&B transaction log or holds a corrupt record."""
    log = read_log(path)
    if log.corrupt:
        raise InputError(f"{printable(str(path))}: {log.corrupt}")
    return [record for _, record in log.records]


def _finite(value: Any) -> Any:
    """``value`` with NaN and the infinities, at any depth, as None (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def history_row(record: Any) -> dict[str, Any]:
    """One history record (a ``wandb.log`` call) as a dict, values decoded from JSON, NaN and the
    infinities as None; ValueError for a value that is not JSON."""
    return _items(record.history.item)


def _items(items: Any) -> dict[str, Any]:
    """History or summary items as a dict: a nested key joined with "/", values decoded from JSON."""
    row = {}
    for item in items:
        key = item.key or "/".join(item.nested_key)
        try:
            row[key] = _finite(json.loads(item.value_json))
        except (ValueError, RecursionError):
            raise ValueError(f"the value of {key!r} is not JSON (or nested too deep)") from None
    return row


def read_history(path: str | Path) -> list[dict[str, Any]]:
    """The logged history rows of one ``.wandb`` file (:func:`read_records`, :func:`history_row`)."""
    return [history_row(r) for r in read_records(path) if r.WhichOneof("record_type") == "history"]


def read_summary(path: str | Path) -> dict[str, Any]:
    """The run summary of one ``.wandb`` file as its summary records leave it (each updates some keys,
    the last one a finished run writes holds them all): a key defined with ``summary="min,mean"`` maps to
    ``{"min": ..., "mean": ...}``, the others to their last value; keys as in :func:`history_row`."""
    summary: dict[str, Any] = {}
    for record in read_records(path):
        if record.WhichOneof("record_type") == "summary":
            summary.update(_items(record.summary.update))
            for item in record.summary.remove:
                summary.pop(item.key or "/".join(item.nested_key), None)
    return summary


def find_offline_runs(root: str | Path) -> list[Path]:
    """All ``offline-run-*/run-*.wandb`` entries under ``root`` (files or not: the reader checks)."""
    return sorted(Path(root).rglob("offline-run-*/run-*.wandb"))


UNFINISHED = ("the run did not finish (no exit record: it stopped before wandb.finish, e.g. on a signal); "
              "what it logged after its last written record is not in the file")


def _print_run(path: Path) -> bool:
    """Print one run's history rows (stdout) and its one line (stderr); False when it is not readable
    to its end for another reason than a cut."""
    shown = printable(str(path))
    log = read_log(path)
    rows, problem, read = [], log.corrupt, len(log.records)
    for i, (offset, record) in enumerate(log.records):
        if record.WhichOneof("record_type") == "history":
            try:
                rows.append(history_row(record))
            except ValueError as e:
                problem, read = f"the record at byte {offset} is corrupt ({e})", i
                break
    if problem:
        print(f"error: {shown}: {printable(problem)}; {read} records read before it", file=sys.stderr)
    elif log.cut:
        print(f"{shown}: {len(log.records)} records read; the file ends mid-record at byte {log.size}",
              file=sys.stderr)
    elif not any(record.WhichOneof("record_type") == "exit" for _, record in log.records):
        print(f"{shown}: {UNFINISHED}", file=sys.stderr)
    else:
        print(shown, file=sys.stderr)
    for row in rows:
        print(json.dumps(row, allow_nan=False))
    return problem is None


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Every offline run under a folder (or one ``.wandb`` file): one line about it on stderr, then its
    history rows, one JSON object a line on stdout. Exit code 0, 1 when there is no run, 2 when a path
    or a run cannot be read (the rows before a corrupt record are still printed)."""
    p = ToolParser(prog=prog, description="Print the logged history of the W&B offline runs "
                   "(offline-run-*/run-*.wandb) under a folder, or of one .wandb file, one JSON object per "
                   "line, without W&B's servers; a line per run goes to stderr.")
    p.add_argument("root", nargs="?", default=".", help="folder searched for offline runs (e.g. a dump folder), "
                   "or one .wandb file")
    status = 0
    try:
        a = p.parse_args(argv)
        try:
            mode = os.stat(a.root).st_mode
        except OSError as e:
            raise InputError(f"{printable(a.root)}: {e.strerror or e}") from None
        if stat.S_ISDIR(mode):
            runs = find_offline_runs(a.root)
        elif stat.S_ISREG(mode):
            runs = [Path(a.root)]
        else:
            raise InputError(f"{printable(a.root)}: not a folder nor a regular file; not read")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        _records_module()
    except ModuleNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not runs:
        print(f"no W&B offline run (offline-run-*/run-*.wandb) under {printable(a.root)}", file=sys.stderr)
        return 1
    for f in runs:
        try:
            if not _print_run(f):
                status = 2
        except InputError as e:
            print(f"error: {e}", file=sys.stderr)
            status = 2
    return status


if __name__ == "__main__":
    sys.exit(main())
