"""The two run readers on hostile input, kept as tables: ``titan-ext summary`` (pipeline_metrics.jsonl)
and ``titan-ext wandb-offline`` (W&B's ``.wandb`` transaction log). Runs that ended badly stay readable:
every case asserts the exit code, exactly one line on stderr where the case is an error (no traceback),
the files under the test's folder unchanged, and for a cut or damaged run the exact rows that must come
back, computed from what the test wrote -- never from the reader.

The ``.wandb`` files are written by :func:`_log_bytes`, a writer built from W&B's own spec (the Python
``wandb/sdk/internal/datastore.py`` of earlier wandb releases, which recent ones no longer ship, and
wandb-core's ``core/pkg/leveldb/record.go``): 32 KiB blocks, zero trailers, FULL/FIRST/MIDDLE/LAST
chunks, and the checksum W&B uses, ``zlib.crc32(data, zlib.crc32(bytes([type])))``. :data:`_REAL_RECORD`
holds bytes wandb-core 0.31 wrote itself (one history record), so the reader is checked against the real
writer too. Everything runs in-process; a FIFO is never opened (``pytest.mark.timeout`` guards it)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import stat
import struct
import zlib
from pathlib import Path

import pytest

from titan_ext.cli import main
from titan_ext.titan import wandb_offline
from titan_ext.titan.summary import printable

FIFO_TIMEOUT = pytest.mark.timeout(10)


def _cli(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``: a regular file by its content's hash, anything else by its kind (a FIFO
    is never opened)."""
    found = {}
    for p in sorted(root.rglob("*")):
        mode = p.lstat().st_mode
        found[str(p.relative_to(root))] = (hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(mode)
                                           else stat.filemode(mode)[0])
    return found


def _one_error_line(err: str, *needles: str) -> None:
    assert "Traceback" not in err, err
    assert err.endswith("\n") and err.count("\n") == 1 and err.startswith("error: "), err
    for needle in needles:
        assert needle in err, (needle, err)


# --------------------------------------------------------------------------------------------------------
# summary

def _row(step: int, **extra) -> dict:
    row = {"step": step, "schedule": "PipeMorph", "loss": 3.0 - step / 10, "iteration_ms": 100.0 + 7 * step,
           "bubble_rate": 0.2 + step / 100, "plan_version": 1 + (step > 4), "train_step_ms": 120.0 + step,
           "link_delay_ms": {"0": 1.0 + step, "1": 2.0}}
    row.update(extra)
    return row


def _lines(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _run(tmp_path: Path, name: str, data: bytes) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "pipeline_metrics.jsonl").write_bytes(data)
    return d


GOOD = _lines(_row(s) for s in range(1, 9))


def _missing(t, mp):
    return [t / "nope"]


def _empty(t, mp):
    return [_run(t, "r", b"")]


def _blank_lines_only(t, mp):
    return [_run(t, "r", b"\n  \n\n")]


def _garbage_only(t, mp):
    return [_run(t, "r", b"not json\n{\"step\": 1\n[1, 2]\n")]


def _binary(t, mp):
    return [_run(t, "r", bytes(range(256)) * 8 + b"\xff\xfe\x00\n\x89PNG\r\n\x1a\n")]


def _nested(t, mp):
    return [_run(t, "r", b"[" * 100_000 + b"]" * 100_000 + b"\n" + b'{"a":' * 50_000 + b"1" + b"}" * 50_000)]


def _wrong_types(t, mp):
    rows = [{**_row(1), "step": "1"}, {**_row(2), "step": True}, {**_row(3), "step": 3.0}, _row(4, iteration_ms="fast"),
            _row(5, bubble_rate=True), _row(6, bubble_rate=[0.1])]
    bad = [{k: v for k, v in _row(7).items() if k != "iteration_ms"}, ["step", 1], "step", 8, None]
    return [_run(t, "r", _lines(rows + bad))]


def _huge_step_digits(t, mp):
    return [_run(t, "r", b'{"step": ' + b"9" * 5000 + b', "iteration_ms": 1, "bubble_rate": 0}\n')]


def _no_metrics_file(t, mp):
    (t / "r").mkdir()
    (t / "r" / "other.jsonl").write_bytes(GOOD)
    return [t / "r"]


def _metrics_is_a_folder(t, mp):
    (t / "r" / "pipeline_metrics.jsonl").mkdir(parents=True)
    return [t / "r"]


def _file_as_folder(t, mp):
    run = _run(t, "r", GOOD)
    return [f"{run / 'pipeline_metrics.jsonl'}/"]


def _fifo_in_run(t, mp):
    (t / "r").mkdir()
    os.mkfifo(t / "r" / "pipeline_metrics.jsonl")
    return [t / "r"]


def _fifo_given(t, mp):
    os.mkfifo(t / "m.jsonl")
    return [t / "m.jsonl"]


def _device(t, mp):
    return ["/dev/zero"]


def _symlink_loop(t, mp):
    os.symlink(t / "loop", t / "loop")
    return [t / "loop"]


def _unreadable(t, mp):
    run = _run(t, "r", GOOD)
    metrics = run / "pipeline_metrics.jsonl"
    metrics.chmod(0)
    if os.geteuid() == 0:  # root reads a mode-0 file: refuse the open as the kernel would for a user
        real_open = os.open

        def refusing(path, *args, **kwargs):
            if os.fspath(path) == str(metrics):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, *args, **kwargs)

        mp.setattr(os, "open", refusing)
    return [run]


def _json_is_run_a(t, mp):  # `--json RUN_A RUN_B`: argparse takes RUN_A as the output
    return ["--json", _run(t, "a", GOOD), _run(t, "b", GOOD)]


def _json_is_run_a_file(t, mp):
    a, b = _run(t, "a", GOOD), _run(t, "b", GOOD)
    return ["--json", a / "pipeline_metrics.jsonl", b / "pipeline_metrics.jsonl"]


def _json_is_input_by_symlink(t, mp):
    a = _run(t, "a", GOOD)
    os.symlink(a / "pipeline_metrics.jsonl", t / "out.json")
    return [a, "--json", t / "out.json"]


def _json_is_input_by_hardlink(t, mp):
    a = _run(t, "a", GOOD)
    os.link(a / "pipeline_metrics.jsonl", t / "out.json")
    return [a, "--json", t / "out.json"]


def _json_is_input_file(t, mp):
    a = _run(t, "a", GOOD)
    return [a / "pipeline_metrics.jsonl", "--json", a / "pipeline_metrics.jsonl"]


def _json_in_missing_folder(t, mp):
    return [_run(t, "a", GOOD), "--json", t / "no" / "out.json"]


def _json_is_fifo(t, mp):
    os.mkfifo(t / "out.json")
    return [_run(t, "a", GOOD), "--json", t / "out.json"]


def _json_names_a_folder(t, mp):
    return [_run(t, "a", GOOD), "--json", f"{t / 'new'}/"]


def _names_mismatch(t, mp):
    return [_run(t, "a", GOOD), _run(t, "b", GOOD), "--names", "x"]


def _bad_skip(t, mp):
    return [_run(t, "a", GOOD), "--skip", "many"]


SUMMARY_ERRORS = [
    pytest.param(_missing, "No such file or directory", id="missing-path"),
    pytest.param(_empty, "an empty file", id="empty-file"),
    pytest.param(_blank_lines_only, "an empty file", id="blank-lines-only"),
    pytest.param(_garbage_only, "no valid step (3 lines skipped)", id="no-valid-step"),
    pytest.param(_binary, "no valid step (", id="binary-garbage"),
    pytest.param(_nested, "no valid step (2 lines skipped)", id="deeply-nested-json"),
    pytest.param(_wrong_types, "no valid step (11 lines skipped)", id="wrong-types"),
    pytest.param(_huge_step_digits, "no valid step (1 line skipped)", id="huge-int-digits"),
    pytest.param(_no_metrics_file, "a folder without pipeline_metrics.jsonl", id="folder-without-metrics"),
    pytest.param(_metrics_is_a_folder, "a folder, not a metrics file", id="metrics-file-is-a-folder"),
    pytest.param(_file_as_folder, "Not a directory", id="file-given-as-folder"),
    pytest.param(_fifo_in_run, "not a regular file", id="fifo-metrics", marks=FIFO_TIMEOUT),
    pytest.param(_fifo_given, "not a regular file", id="fifo-given", marks=FIFO_TIMEOUT),
    pytest.param(_device, "not a regular file", id="device", marks=FIFO_TIMEOUT),
    pytest.param(_symlink_loop, "Too many levels of symbolic links", id="symlink-loop"),
    pytest.param(_unreadable, "Permission denied", id="unreadable"),
    pytest.param(_json_is_run_a, "a folder (a run?); --json takes the output file", id="json-RUN_A-RUN_B"),
    pytest.param(_json_is_run_a_file, "a metrics file (.jsonl)", id="json-RUN_A-file"),
    pytest.param(_json_is_input_by_symlink, "an input of this summary", id="json-symlink-to-input"),
    pytest.param(_json_is_input_by_hardlink, "an input of this summary", id="json-hardlink-to-input"),
    pytest.param(_json_is_input_file, "an input of this summary", id="json-is-the-input"),
    pytest.param(_json_in_missing_folder, "No such file or directory", id="json-missing-folder"),
    pytest.param(_json_is_fifo, "not a regular file", id="json-fifo", marks=FIFO_TIMEOUT),
    pytest.param(_json_names_a_folder, "is a directory path", id="json-trailing-slash"),
    pytest.param(_names_mismatch, "--names gives 1 names for 2 runs", id="names-count"),
    pytest.param(_bad_skip, "invalid int value", id="bad-option"),
]


@pytest.mark.parametrize("build,message", SUMMARY_ERRORS)
def test_summary_refuses_in_one_line(build, message, tmp_path, capsys, monkeypatch):
    argv = build(tmp_path, monkeypatch)
    before = _tree(tmp_path)
    code, out, err = _cli(["summary", *argv], capsys)
    monkeypatch.undo()  # os.open back before reading the tree
    assert code == 2 and out == "", (code, out, err)
    _one_error_line(err, message)
    assert _tree(tmp_path) == before  # no input touched, no output or temporary file left


def _medians_by_hand(rows, skip):
    steady = [r for r in rows if r["step"] > skip]
    return statistics.median(r["iteration_ms"] for r in steady), statistics.median(r["bubble_rate"] for r in steady)


def test_summary_half_written_last_line_counts_as_skipped(tmp_path, capsys):
    rows = [_row(s) for s in range(1, 9)]
    last = json.dumps(_row(9)).encode()
    run = _run(tmp_path, "r", _lines(rows) + last[:len(last) // 2])  # killed mid-write
    before = _tree(tmp_path)
    code, out, err = _cli(["summary", run, "--json"], capsys)
    assert code == 0 and "Traceback" not in err
    (got,) = json.loads(out)
    it, bubble = _medians_by_hand(rows, 3)
    assert got["steps"] == 8 and got["skipped_lines"] == 1 and got["median_steps_from"] == 4
    assert got["iteration_ms"] == it and got["bubble_rate"] == bubble
    assert got["loss_first"] == rows[0]["loss"] and got["loss_last"] == rows[-1]["loss"]
    assert got["plan_versions"] == [1, 2]
    assert got["link_delay_ms"] == {"0": statistics.median(1.0 + s for s in range(4, 9)), "1": 2.0}
    assert "note: " in err and "1 line skipped" in err and "lines skipped" in err  # the note and the table row
    assert _tree(tmp_path) == before


def test_summary_skips_and_counts_bad_lines_among_good_ones(tmp_path, capsys):
    good = [_row(s) for s in (2, 1, 3, 5, 4)]  # unsorted: read back by step
    bad = [b"garbage", b"[" * 10_000, b'{"step": "7"}', b'{"step": 8, "iteration_ms": 1}', b"\x00\xff\xfe",
           b'{"step": 9, "iteration_ms": 1e999999, "bubble_rate": "x"}']
    data = b"".join(json.dumps(r).encode() + b"\n" + bad[i] + b"\n" for i, r in enumerate(good)) + bad[5] + b"\n"
    code, out, err = _cli(["summary", _run(tmp_path, "r", data), "--skip", "0", "--json"], capsys)
    assert code == 0, err
    (got,) = json.loads(out)
    rows = sorted(good, key=lambda r: r["step"])
    it, bubble = _medians_by_hand(rows, 0)
    assert (got["steps"], got["skipped_lines"], got["iteration_ms"], got["bubble_rate"]) == (5, 6, it, bubble)
    assert got["loss_first"] == rows[0]["loss"] and got["loss_last"] == rows[-1]["loss"]


NON_FINITE = b"\n".join([
    b'{"step": 1, "loss": null, "iteration_ms": NaN, "bubble_rate": null, "train_step_ms": Infinity}',
    b'{"step": 2, "loss": 1e999, "iteration_ms": null, "bubble_rate": NaN, "link_delay_ms": {"0": -Infinity}}',
    b'{"step": 3, "iteration_ms": 1e400, "bubble_rate": -1e999, "plan_version": "v2", "link_delay_ms": [1]}',
    b'{"step": 4, "loss": NaN, "iteration_ms": ' + b"9" * 400 + b', "bubble_rate": Infinity, "loss": "low"}',
]) + b"\n"


def test_summary_null_nan_inf_huge_are_na_and_null(tmp_path, capsys):
    run = _run(tmp_path, "r", NON_FINITE)
    code, out, err = _cli(["summary", run, "--skip", "0", "--json"], capsys)
    assert code == 0 and "Traceback" not in err, err
    json.loads(out, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    (got,) = json.loads(out)
    assert got["skipped_lines"] == 0  # null / NaN / huge are numbers the writer may log, not broken lines
    for key in ("iteration_ms", "train_step_ms", "bubble_rate", "loss_first", "loss_last"):
        assert got[key] is None, key
    assert got["link_delay_ms"] == {"0": None} and got["plan_versions"] == [0]
    table = err.splitlines()
    for label in ("iteration time", "train step", "bubble rate", "loss, first", "loss, last"):
        (line,) = [ln for ln in table if ln.startswith(label)]
        assert line.endswith("n/a") or line.endswith("n/a %"), line


def test_summary_escapes_control_characters_from_the_run(tmp_path, capsys):
    evil = "Pipe\x1b[31mMorph\x07\n\u202e\ud800"
    rows = [_row(s, schedule=evil, link_delay_ms={"\x1b]0;pwn\x07": 1.0}) for s in range(1, 5)]
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    code, out, err = _cli(["summary", _run(tmp_path, "r", data), _run(tmp_path, "b", GOOD)], capsys)
    assert code == 0, err
    assert not any(ord(c) < 32 and c != "\n" for c in out) and "\u202e" not in out and "\ud800" not in out
    assert "Pipe\\x1b[31mMorph\\x07\\n\\u202e\\ud800" in out and "\\x1b]0;pwn\\x07:1.0" in out
    assert out.splitlines()[-1].startswith("Pipe\\x1b[31mMorph") and "as fast as PipeMorph" in out  # escaped


def test_printable():
    assert printable("plain text, ü and 中文") == "plain text, ü and 中文"
    assert printable("\x1b[2J\r\t\x7f\u200b") == "\\x1b[2J\\r\\t\\x7f\\u200b"


def test_summary_json_written_atomically_and_strict(tmp_path, capsys):
    run = _run(tmp_path, "r", GOOD + NON_FINITE.replace(b'"step": ', b'"step": 1'))
    out_path = tmp_path / "out.json"
    out_path.write_text("the user's old summary\n")
    os.chmod(out_path, 0o640)
    code, out, err = _cli(["summary", run, "--json", out_path], capsys)
    assert code == 0 and err == "", err
    got = json.loads(out_path.read_text(), parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert got[0]["steps"] == 14 and "iteration time" in out
    assert stat.S_IMODE(out_path.stat().st_mode) == 0o640  # the replaced file's mode is kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "r"]  # no temporary file left
    code, out, err = _cli(["summary", run, "--json", "-"], capsys)  # `--json -`: stdout, table on stderr
    assert code == 0 and json.loads(out)[0]["steps"] == 14 and "iteration time" in err


# --------------------------------------------------------------------------------------------------------
# wandb-offline

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4

# One history record as wandb-core 0.31.0 wrote it (offline run, `run.log({...}, step=1)`), chunk header
# included: a FULL chunk of 160 bytes at byte 1296 of its file.
_REAL_RECORD = bytes.fromhex(
    "daaf564fa00001080b129b010a1812085f72756e74696d6582010b302e3438323930373130320a0b12055f73746570820101"
    "310a0c12046c6f7373820103312e390a0d120569745f6d738201033130310a1e12046e616d6582011522506970654d6f7270"
    "685c75303031625b33316d220a0b12036e616e8201034e614e0a24120a5f74696d657374616d70820115312e373935393131"
    "333236313038393539652b303912020801")
_REAL_ROW = {"_runtime": 0.482907102, "_step": 1, "loss": 1.9, "it_ms": 101, "name": "PipeMorph\x1b[31m",
             "nan": None, "_timestamp": 1.795911326108959e09}


def _chunk(kind: int, data: bytes) -> bytes:
    """A chunk as datastore.py writes it: checksum = zlib.crc32(data, zlib.crc32(bytes([type])))."""
    return struct.pack("<IHB", zlib.crc32(data, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF, len(data), kind) + data


class _Log:
    """datastore.py's DataStore._write_data, into memory; keeps where each record starts and ends."""

    def __init__(self):
        self.data = bytearray(HEADER)
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, s: bytes) -> None:
        space = BLOCK - len(self.data) % BLOCK
        if space < 7:
            self.data += b"\0" * space
            space = BLOCK
        self.starts.append(len(self.data))
        if len(s) + 7 <= space:
            self.data += _chunk(FULL, s)
        else:
            used = space - 7
            self.data += _chunk(FIRST, s[:used])
            while len(s) - used > BLOCK - 7:
                self.data += _chunk(MIDDLE, s[used:used + BLOCK - 7])
                used += BLOCK - 7
            self.data += _chunk(LAST, s[used:])
        self.ends.append(len(self.data))


def _history(row: dict, pad: int = 0) -> bytes:
    """A serialized history Record of ``row`` (keys as wandb-core writes them: nested_key), with a
    ``pad`` string of that many characters when asked."""
    from wandb.proto import wandb_internal_pb2 as pb

    record = pb.Record()
    for key, value in {**row, **({"pad": "x" * pad} if pad else {})}.items():
        item = record.history.item.add()
        item.nested_key.append(key)
        item.value_json = json.dumps(value)
    return record.SerializeToString()


def _history_of_size(row: dict, size: int) -> tuple[bytes, dict]:
    pad = max(1, size - len(_history(row)))
    while len(data := _history(row, pad)) != size:
        pad += size - len(data)
    return data, {**row, "pad": "x" * pad}


def _other_record() -> bytes:
    from wandb.proto import wandb_internal_pb2 as pb

    record = pb.Record()
    record.summary.update.add(key="loss", value_json="1.5")
    return record.SerializeToString()


def _build_run():
    """A run whose records cover every layout: FULL chunks, a record ending 7 bytes before a block end
    (the next one starts with an empty FIRST chunk), a zero trailer, a record over three blocks
    (FIRST, MIDDLE, LAST), non-history records, control characters and NaN in the values."""
    log, rows = _Log(), []  # rows[i]: the history row of record i (None: not a history record)

    def add(payload: bytes, row: dict | None) -> None:
        log.add(payload)
        rows.append(row)

    for step in range(1, 4):
        row = {"_step": step, "loss": 3.0 - step / 10, "name": "PipeMorph\x1b[31m\u202e", "nan": math.nan}
        add(_history(row), {**row, "nan": None})
        add(_other_record(), None)
    row = {"_step": 4, "loss": 2.5}
    payload, full = _history_of_size(row, BLOCK - 7 - len(log.data) - 7)  # leaves exactly 7 bytes
    add(payload, full)
    add(_history({"_step": 5, "loss": 2.4}), {"_step": 5, "loss": 2.4})  # an empty FIRST, then its LAST
    payload, full = _history_of_size({"_step": 6}, 2 * BLOCK - 3 - len(log.data) - 7)  # leaves 3 bytes
    add(payload, full)
    add(_history({"_step": 7, "big": "y" * 70_000}), {"_step": 7, "big": "y" * 70_000})  # three blocks
    for step in range(8, 12):
        add(_history({"_step": step, "loss": 2.0 - step / 100, "inf": math.inf}),
            {"_step": step, "loss": 2.0 - step / 100, "inf": None})
    add(_exit_record(), None)  # wandb.finish
    return bytes(log.data), log.starts, log.ends, rows


def _exit_record() -> bytes:
    from wandb.proto import wandb_internal_pb2 as pb

    record = pb.Record()
    record.exit.exit_code = 0
    return record.SerializeToString()


_RUN = None


def _run_log():
    global _RUN
    if _RUN is None:
        _RUN = _build_run()
    return _RUN


def test_the_built_run_covers_every_layout():
    data, starts, ends, rows = _run_log()
    assert starts[7] == BLOCK - 7 and struct.unpack_from("<HB", data, BLOCK - 3) == (0, FIRST)  # empty FIRST
    assert data[2 * BLOCK - 3:2 * BLOCK] == b"\0\0\0" and starts[9] == 2 * BLOCK  # a zero trailer
    kinds = [data[2 * BLOCK + 6], data[3 * BLOCK + 6], data[4 * BLOCK + 6]]
    assert kinds == [FIRST, MIDDLE, LAST]


def _offline_run(tmp_path: Path, data: bytes, name: str = "offline-run-1-abc") -> Path:
    d = tmp_path / "wandb" / name
    d.mkdir(parents=True)
    (d / "run-abc.wandb").write_bytes(data)
    return d / "run-abc.wandb"


def _expected_rows(rows, upto: int) -> list[dict]:
    return [r for r in rows[:upto] if r is not None]


def _printed_rows(out: str) -> list[dict]:
    return [json.loads(line, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
            for line in out.splitlines()]


def test_wandb_whole_run(tmp_path, capsys):
    data, _, _, rows = _run_log()
    path = _offline_run(tmp_path, data)
    code, out, err = _cli(["wandb-offline", tmp_path], capsys)
    assert code == 0 and err == f"{path}\n", err
    assert _printed_rows(out) == _expected_rows(rows, len(rows))
    assert "\x1b" not in out and "\u202e" not in out  # JSON escapes them
    assert wandb_offline.read_history(path) == _expected_rows(rows, len(rows))


# cuts: where the file ends -> (records complete before the cut, whether the reader must say it is cut)
CUTS = [
    pytest.param(lambda s, e: 0, lambda s, e: 0, True, id="empty-file"),
    pytest.param(lambda s, e: 3, lambda s, e: 0, True, id="in-file-header"),
    pytest.param(lambda s, e: 7, lambda s, e: 0, False, id="header-only"),
    pytest.param(lambda s, e: 7 + 4, lambda s, e: 0, True, id="in-first-chunk-header"),
    pytest.param(lambda s, e: e[0] - 1, lambda s, e: 0, True, id="in-first-payload"),
    pytest.param(lambda s, e: e[4], lambda s, e: 5, False, id="on-a-record-boundary"),
    pytest.param(lambda s, e: e[4] + 20, lambda s, e: 5, True, id="in-a-later-record"),
    pytest.param(lambda s, e: BLOCK - 3, lambda s, e: 7, True, id="in-an-empty-first-chunk"),
    pytest.param(lambda s, e: BLOCK, lambda s, e: 7, True, id="between-first-and-last"),
    pytest.param(lambda s, e: 2 * BLOCK - 2, lambda s, e: 9, False, id="in-a-zero-trailer"),
    pytest.param(lambda s, e: 3 * BLOCK + 100, lambda s, e: 9, True, id="in-a-middle-chunk"),
    pytest.param(lambda s, e: e[-1] - 1, lambda s, e: len(e) - 1, True, id="last-byte-missing"),
]


@pytest.mark.parametrize("cut,complete,says_cut", CUTS)
def test_wandb_cut_run_returns_every_complete_record(cut, complete, says_cut, tmp_path, capsys):
    data, starts, ends, rows = _run_log()
    at, n = cut(starts, ends), complete(starts, ends)
    assert all(e <= at for e in ends[:n]) and all(e > at for e in ends[n:])  # the table is right
    path = _offline_run(tmp_path, data[:at])
    before = _tree(tmp_path)
    code, out, err = _cli(["wandb-offline", tmp_path], capsys)
    assert code == 0 and "Traceback" not in err
    # a file cut on a record boundary ends cleanly, but before the run's exit record
    note = f"{path}: {n} records read; the file ends mid-record at byte {at}\n" if says_cut \
        else f"{path}: {wandb_offline.UNFINISHED}\n"
    assert err == note
    assert _printed_rows(out) == _expected_rows(rows, n)
    assert _tree(tmp_path) == before


def test_wandb_zero_tail_is_a_cut(tmp_path, capsys):
    data, _, ends, rows = _run_log()
    path = _offline_run(tmp_path, data[:ends[3]] + bytes(5000))
    code, out, err = _cli(["wandb-offline", path], capsys)
    assert code == 0 and err == f"{path}: 4 records read; the file ends mid-record at byte {ends[3] + 5000}\n"
    assert _printed_rows(out) == _expected_rows(rows, 4)


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1:]


def _set_header(data: bytes, at: int, kind: int | None = None, length: int | None = None) -> bytes:
    """Rewrite the chunk header at ``at`` with a right checksum for what it now says."""
    _, old_length, old_kind = struct.unpack_from("<IHB", data, at)
    kind = old_kind if kind is None else kind
    length = old_length if length is None else length
    payload = data[at + 7:at + 7 + length]
    return data[:at] + _chunk(kind, payload)[:7] + data[at + 7:]


# damage -> (records before it, the words of the one error line)
DAMAGE = [
    pytest.param(lambda d, s: _flip(d, s[2] + 20), 2, lambda s: f"the chunk at byte {s[2]} is corrupt (checksum mismatch)",
                 id="payload-bit-flip"),
    pytest.param(lambda d, s: _flip(d, s[3]), 3, lambda s: f"the chunk at byte {s[3]} is corrupt (checksum mismatch)",
                 id="checksum-bit-flip"),
    pytest.param(lambda d, s: _flip(d, 3 * BLOCK + 500), 9, lambda s: f"the chunk at byte {3 * BLOCK} is corrupt "
                 "(checksum mismatch)", id="middle-chunk-bit-flip"),
    pytest.param(lambda d, s: _set_header(d, s[2], length=BLOCK), 2, lambda s: f"the chunk at byte {s[2]} is corrupt "
                 f"(length {BLOCK} beyond its block)", id="length-beyond-block"),
    pytest.param(lambda d, s: _set_header(d, s[1], kind=9), 1, lambda s: f"the chunk at byte {s[1]} is corrupt "
                 "(unknown type 9)", id="unknown-type"),
    pytest.param(lambda d, s: _set_header(d, s[1], kind=LAST), 1, lambda s: f"the chunk at byte {s[1]} is corrupt "
                 "(type 4 continues no record)", id="last-without-first"),
    pytest.param(lambda d, s: _set_header(d, s[1], kind=FIRST), 1, lambda s: f"the record at byte {s[1]} is corrupt "
                 f"(no LAST chunk before byte {s[2]})", id="first-without-last"),
    pytest.param(lambda d, s: d[:2 * BLOCK - 2] + b"\x01" + d[2 * BLOCK - 1:], 9,
                 lambda s: f"the block trailer at byte {2 * BLOCK - 3} is not zeros", id="trailer-not-zero"),
    pytest.param(lambda d, s: d[:s[2]] + _chunk(FULL, b"\xff\xff\xff\xff") + d[s[2]:], 2,
                 lambda s: f"the record at byte {s[2]} is not a W&B record", id="not-a-protobuf-record"),
    pytest.param(lambda d, s: d[:s[2]] + _chunk(FULL, _bad_value_record()) + d[s[2]:], 2,
                 lambda s: f"the record at byte {s[2]} is corrupt (the value of 'loss' is not JSON", id="value-not-json"),
]


def _bad_value_record() -> bytes:
    from wandb.proto import wandb_internal_pb2 as pb

    record = pb.Record()
    record.history.item.add(key="loss", value_json="{1.5")
    return record.SerializeToString()


@pytest.mark.parametrize("damage,before_it,message", DAMAGE)
def test_wandb_corrupt_record_is_named_and_nothing_after_it_printed(damage, before_it, message, tmp_path, capsys):
    data, starts, _, rows = _run_log()
    path = _offline_run(tmp_path, damage(data, starts))
    before = _tree(tmp_path)
    code, out, err = _cli(["wandb-offline", tmp_path], capsys)
    assert code == 2
    _one_error_line(err, f"error: {path}: {message(starts)}", f"; {before_it} records read before it")
    assert _printed_rows(out) == _expected_rows(rows, before_it)
    assert _tree(tmp_path) == before
    with pytest.raises(ValueError, match="corrupt|not a W&B record|not JSON"):
        wandb_offline.read_history(path)


def _w_fifo_run(t):
    (t / "offline-run-1-abc").mkdir()
    os.mkfifo(t / "offline-run-1-abc" / "run-abc.wandb")
    return [t]


def _w_folder_run(t):
    (t / "offline-run-1-abc" / "run-abc.wandb").mkdir(parents=True)
    return [t]


def _w_fifo_root(t):
    os.mkfifo(t / "run.wandb")
    return [t / "run.wandb"]


def _w_missing_root(t):
    return [t / "nope"]


def _w_not_wandb(t):
    (t / "x.wandb").write_bytes(b"PK\x03\x04 a zip file, not a W&B log" * 10)
    return [t / "x.wandb"]


def _w_other_version(t):
    (t / "x.wandb").write_bytes(b":W&B" + struct.pack("<HB", 0xBEE1, 1) + _chunk(FULL, b""))
    return [t / "x.wandb"]


def _w_short_garbage(t):
    (t / "x.wandb").write_bytes(b"\x00\x01")
    return [t / "x.wandb"]


def _w_escaped_path(t):
    d = t / "offline-run-\x1b[2J-abc"
    d.mkdir()
    (d / "run-abc.wandb").write_bytes(b"garbage!")
    return [t]


def _w_bad_option(t):
    return ["--frobnicate"]


WANDB_ERRORS = [
    pytest.param(_w_fifo_run, "not a regular file", id="fifo-run-file", marks=FIFO_TIMEOUT),
    pytest.param(_w_folder_run, "not a regular file", id="folder-named-like-a-run"),
    pytest.param(_w_fifo_root, "not a folder nor a regular file", id="fifo-root", marks=FIFO_TIMEOUT),
    pytest.param(_w_missing_root, "No such file or directory", id="missing-root"),
    pytest.param(_w_not_wandb, "not a W&B transaction log", id="not-a-wandb-file"),
    pytest.param(_w_other_version, "a W&B log of another format", id="other-version"),
    pytest.param(_w_short_garbage, "not a W&B transaction log", id="short-garbage"),
    pytest.param(_w_escaped_path, "offline-run-\\x1b[2J-abc", id="control-chars-in-path"),
    pytest.param(_w_bad_option, "unrecognized arguments", id="bad-option"),
]


@pytest.mark.parametrize("build,message", WANDB_ERRORS)
def test_wandb_refuses_in_one_line(build, message, tmp_path, capsys):
    argv = build(tmp_path)
    before = _tree(tmp_path)
    code, out, err = _cli(["wandb-offline", *argv], capsys)
    assert code == 2 and out == "", (code, out, err)
    _one_error_line(err, message)
    assert "\x1b" not in err
    assert _tree(tmp_path) == before


def test_wandb_reads_what_wandb_core_wrote(tmp_path, capsys):
    path = tmp_path / "run-real.wandb"
    path.write_bytes(HEADER + _REAL_RECORD)
    code, out, err = _cli(["wandb-offline", path], capsys)
    assert code == 0 and err == f"{path}: {wandb_offline.UNFINISHED}\n", err  # a history record, no exit
    assert _printed_rows(out) == [_REAL_ROW]
    path.write_bytes(HEADER + _flip(_REAL_RECORD, 40))
    code, out, err = _cli(["wandb-offline", path], capsys)
    assert code == 2 and out == ""
    _one_error_line(err, "the chunk at byte 7 is corrupt (checksum mismatch)")


def _crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), reflected polynomial 0x82F63B78, one byte at a time from a 256-entry table."""
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    crc = 0xFFFFFFFF
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def test_wandb_checksum_is_plain_crc32_not_leveldb_masked_crc32c():
    """W&B's checksum is zlib.crc32 over type byte + payload, unmasked (datastore.py, record.go's
    CRCStandard with CRCAlgoIEEE), not upstream LevelDB's masked CRC-32C: the real record says so."""
    assert zlib.crc32(b"123456789") == 0xCBF43926 and _crc32c(b"123456789") == 0xE3069283  # check values
    crc, length, kind = struct.unpack_from("<IHB", _REAL_RECORD)
    body = _REAL_RECORD[6:7 + length]
    assert (kind, len(body)) == (FULL, 1 + length)
    assert crc == zlib.crc32(body)
    c = _crc32c(body)
    assert crc != ((((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF)
