"""One job per dump folder (``titan_ext.titan.dumplock``): a live owner refuses a second job naming
itself; an owner that is gone (dead pid here, a lock not refreshed from another host, this torchrun
run restarted) is taken over with a WARNING; the lock goes at release, and only its own."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from titan_ext.titan import dumplock
from titan_ext.titan.dumplock import LOCK_NAME, DumpFolderBusy, DumpFolderLock


@pytest.fixture
def warnings(monkeypatch):
    seen = []
    monkeypatch.setattr(dumplock.logger, "warning", seen.append)
    return seen


def _write_lock(folder, **record):
    folder.mkdir(parents=True, exist_ok=True)
    base = {"host": socket.gethostname(), "pid": os.getpid(), "start": None, "run_id": "", "since": time.time()}
    (folder / LOCK_NAME).write_text(json.dumps(base | record))
    return folder / LOCK_NAME


def test_free_folder_is_taken_and_released(tmp_path):
    lock = DumpFolderLock.acquire(tmp_path / "dump", environ={})
    record = json.loads((tmp_path / "dump" / LOCK_NAME).read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    lock.release()
    assert not (tmp_path / "dump" / LOCK_NAME).exists()
    lock.release()  # idempotent


@pytest.mark.multiprocess
def test_a_live_job_on_this_host_refuses_a_second_one_naming_it(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path = _write_lock(tmp_path, pid=sleeper.pid, start=dumplock._start_time(sleeper.pid))
        with pytest.raises(DumpFolderBusy, match=f"in use by another job .*pid {sleeper.pid}"):
            DumpFolderLock.acquire(tmp_path, environ={})
        assert json.loads(path.read_text())["pid"] == sleeper.pid  # untouched
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.multiprocess
def test_a_dead_owner_on_this_host_is_taken_over_with_a_warning(tmp_path, warnings):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _write_lock(tmp_path, pid=gone.pid)
    lock = DumpFolderLock.acquire(tmp_path, environ={})
    assert len(warnings) == 1 and f"pid {gone.pid} on this host no longer runs" in warnings[0]
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_reused_pid_is_not_the_owner(tmp_path, warnings):
    """The pid runs, but another program since (its start time differs)."""
    _write_lock(tmp_path, pid=os.getppid(), start="1")
    DumpFolderLock.acquire(tmp_path, environ={}).release()
    assert len(warnings) == 1 and "no longer runs" in warnings[0]


def test_this_processs_own_lock_is_taken_quietly(tmp_path, warnings):
    """A second trainer in one process (tests, notebooks): its own lock, no warning."""
    first = DumpFolderLock.acquire(tmp_path, environ={})
    second = DumpFolderLock.acquire(tmp_path, environ={})
    assert not warnings and json.loads(second.path.read_text()) == second.record
    first.release()  # not its own any more: stays
    assert second.path.exists()
    second.release()
    assert not second.path.exists()


def test_another_hosts_lock_holds_while_refreshed_and_goes_stale(tmp_path, warnings):
    path = _write_lock(tmp_path, host="elsewhere-node-7", pid=12345)
    with pytest.raises(DumpFolderBusy, match="host elsewhere-node-7, pid 12345"):
        DumpFolderLock.acquire(tmp_path, environ={})
    old = time.time() - dumplock.STALE_S - 10
    os.utime(path, (old, old))
    DumpFolderLock.acquire(tmp_path, environ={}).release()
    assert len(warnings) == 1 and "host elsewhere-node-7 was not refreshed" in warnings[0]


def test_the_same_torchrun_run_takes_its_lock_back(tmp_path, warnings):
    _write_lock(tmp_path, host="elsewhere", pid=1, run_id="job-42")
    DumpFolderLock.acquire(tmp_path, environ={"TORCHELASTIC_RUN_ID": "job-42"}).release()
    assert "torchrun run job-42 restarted" in warnings[0]


def test_release_leaves_a_lock_that_is_not_its_own(tmp_path):
    lock = DumpFolderLock.acquire(tmp_path, environ={})
    path = _write_lock(tmp_path, host="elsewhere", pid=7)  # replaced (by hand, or a takeover)
    lock.release()
    assert json.loads(path.read_text())["host"] == "elsewhere"


def test_the_owner_refreshes_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(dumplock, "HEARTBEAT_S", 0.05)
    lock = DumpFolderLock.acquire(tmp_path, environ={})
    old = time.time() - 1000
    os.utime(lock.path, (old, old))
    deadline = time.time() + 10
    while lock.path.stat().st_mtime < old + 500 and time.time() < deadline:
        time.sleep(0.05)
    assert lock.path.stat().st_mtime > old + 500
    lock.release()


@pytest.mark.multiprocess
def test_a_second_trainer_on_the_folder_exits_2_in_one_line(tmp_path, monkeypatch, capsys):
    """The trainer's hook: rank 0 prints one line and exits 2 (other ranks do not look)."""
    from titan_ext.titan import trainer

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(tmp_path, pid=sleeper.pid, start=dumplock._start_time(sleeper.pid))
        monkeypatch.setattr(trainer._ADAPTER, "dump_folder", lambda config: str(tmp_path))
        monkeypatch.setenv("RANK", "3")
        assert trainer._lock_dump_folder(object()) is None
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(SystemExit) as e:
            trainer._lock_dump_folder(object())
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "in use by another job" in err[0] and str(sleeper.pid) in err[0], err
    finally:
        sleeper.kill()
        sleeper.wait()
