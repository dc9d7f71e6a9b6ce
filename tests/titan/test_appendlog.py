"""The job's JSON-lines files under a full disk (``titan_ext.titan.appendlog``): a line is written whole or
not at all, the writer warns once and training goes on, and the file is written again once it can be."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from titan_ext.titan import appendlog
from titan_ext.titan.appendlog import LineLog, append_lines


REAL_WRITE = os.write


class _DiskFillsAfter:
    """``os.write`` that takes ``room`` more bytes, then fails with ENOSPC (a partial write first)."""

    def __init__(self, room: int):
        self.room = room

    def __call__(self, fd, data):
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = REAL_WRITE(fd, bytes(data[:self.room]))
        self.room -= n
        return n


@pytest.fixture
def warnings(monkeypatch):
    seen = []
    monkeypatch.setattr(appendlog.logger, "warning", seen.append)
    return seen


def _lines(path):
    text = path.read_text()
    assert text == "" or text.endswith("\n"), repr(text[-40:])  # no half-written last line
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.parametrize("room", [0, 1, 17, 40])
def test_a_batch_cut_by_a_full_disk_leaves_the_file_as_it_was(tmp_path, monkeypatch, room):
    path = tmp_path / "m.jsonl"
    append_lines(path, [json.dumps({"step": 1})])
    before = path.read_bytes()
    monkeypatch.setattr(appendlog.os, "write", _DiskFillsAfter(room))
    with pytest.raises(OSError) as e:
        append_lines(path, [json.dumps({"step": 2, "pad": "x" * 30}), json.dumps({"step": 3})])
    assert e.value.errno == errno.ENOSPC
    assert path.read_bytes() == before


def test_line_log_warns_once_goes_on_and_writes_again(tmp_path, monkeypatch, warnings):
    log = LineLog(tmp_path / "sub" / "m.jsonl", "the test file")
    assert log.append([json.dumps({"step": 1})])
    monkeypatch.setattr(appendlog.os, "write", _DiskFillsAfter(5))
    assert not log.append([json.dumps({"step": 2})])
    assert not log.append([json.dumps({"step": 3}), json.dumps({"step": 4})])
    assert len(warnings) == 1 and "cannot append to the test file" in warnings[0] and "No space" in warnings[0]
    monkeypatch.setattr(appendlog.os, "write", REAL_WRITE)  # room again
    assert log.append([json.dumps({"step": 5})])
    assert len(warnings) == 2 and "3 line(s) lost" in warnings[1]
    assert [r["step"] for r in _lines(log.path)] == [1, 5]


def test_a_real_full_device_is_a_warning_not_an_error(warnings):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    log = LineLog(Path("/dev/full"), "the test file")
    assert not log.append(["{}"]) and log.lost == 1 and len(warnings) == 1


def test_the_pipeline_metrics_file_goes_through_it():
    """The metrics writer and Falcon's two files append through :class:`LineLog`, not ``open(..., "a")``."""
    import inspect

    from titan_ext.titan import metrics
    from titan_ext.titan import falcon_events as events

    for module in (metrics, events):
        source = inspect.getsource(module)
        assert "LineLog(" in source and '"a")' not in source, module.__name__
