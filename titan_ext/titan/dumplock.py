"""One job per dump folder: a lock file that rank 0 takes before any process group exists.

Two jobs given the same ``dump_folder`` would append to one metrics file and replace each other's
checkpoints without a word. Rank 0 of a job writes ``<dump_folder>/.titan_ext.lock`` (JSON: host, pid,
the process's start time, torchrun's run id, when) with ``O_EXCL``; a second job's rank 0 finds it and
stops in one line naming the owner. A lock whose owner is gone is taken over with a WARNING: on this
host, its pid no longer runs (or runs another program: its start time differs); on another host, the
owner has not refreshed the lock's mtime (a daemon thread touches it every :data:`HEARTBEAT_S`) for
:data:`STALE_S`. The lock goes at a clean exit (the trainer's ``close``, ``atexit``); a job restarted by
torchrun (same run id) takes its own lock back. Only rank 0 looks: the other ranks of a refused job
are ended by torchrun when rank 0 exits.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

from torchtitan.tools.logging import logger

__all__ = ["LOCK_NAME", "DumpFolderBusy", "DumpFolderLock", "HEARTBEAT_S", "STALE_S"]

LOCK_NAME = ".titan_ext.lock"
HEARTBEAT_S = 30.0
"""How often the owner refreshes the lock's mtime."""
STALE_S = 300.0
"""A lock from another host not refreshed for this long belongs to a job that is gone."""


class DumpFolderBusy(ValueError):
    """The dump folder is in use by a live job (raised before any process group exists)."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _running(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    now = _start_time(pid)
    return start is None or now is None or now == start


class DumpFolderLock:
    """The lock this process holds on a dump folder (:meth:`acquire`; :meth:`release`)."""

    def __init__(self, path: Path, record: dict):
        self.path, self.record = path, record
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="titan_ext-dump-lock", daemon=True)
        self._thread.start()
        atexit.register(self.release)

    @classmethod
    def acquire(cls, dump_folder: str | os.PathLike, environ=os.environ) -> "DumpFolderLock":
        """Take the folder's lock for this process; :class:`DumpFolderBusy` when a live job holds it."""
        path = Path(dump_folder) / LOCK_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid()),
              "run_id": environ.get("TORCHELASTIC_RUN_ID", ""), "since": time.time()}
        for _ in range(3):  # another job may take or drop it between our reads: look again
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                owner = cls._owner(path)
                if owner is None:
                    continue
                if owner.get("host") == me["host"] and owner.get("pid") == me["pid"]:
                    reason = ""  # this process's own (a second trainer in one process): no news
                else:
                    reason = cls._gone(owner, me, path)
                if reason is None:
                    raise DumpFolderBusy(
                        f"dump folder {path.parent} is in use by another job (host {owner.get('host')}, pid "
                        f"{owner.get('pid')}, since {time.ctime(owner.get('since', 0))}): give this job its own "
                        f"--job.dump_folder, or stop that job (if it is gone, delete {path})")
                if reason:
                    logger.warning(f"[titan_ext] dump folder {path.parent}: taking over the lock of a job that "
                                   f"is gone ({reason})")
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            return cls(path, me)
        raise DumpFolderBusy(f"dump folder {path.parent}: its lock {path} keeps changing (another job is "
                             f"starting in it)")

    @staticmethod
    def _owner(path: Path) -> dict | None:
        """The lock's record, None if it went meanwhile; an unreadable lock is an owner of its own."""
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as e:
            return {"host": "?", "pid": "?", "error": str(e)}
        try:
            owner = json.loads(text)
        except ValueError:
            owner = None
        return owner if isinstance(owner, dict) else {"host": "?", "pid": "?", "error": "not a lock record"}

    @staticmethod
    def _gone(owner: dict, me: dict, path: Path) -> str | None:
        """Why the owner is gone (a reason to print), None when it may be alive."""
        if me["run_id"] and owner.get("run_id") == me["run_id"]:
            return f"this job's own, torchrun run {me['run_id']} restarted"
        if owner.get("host") == me["host"] and isinstance(owner.get("pid"), int):
            if not _running(owner["pid"], owner.get("start")):
                return f"pid {owner['pid']} on this host no longer runs"
            return None
        try:
            idle = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return "its lock went"
        if idle > STALE_S:
            return f"its lock on host {owner.get('host')} was not refreshed for {idle:.0f} s"
        return None

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        """Remove the lock if it is still this process's (idempotent)."""
        self._stop.set()
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if json.loads(self.path.read_text()) == self.record:
                self.path.unlink()
