"""Bounded waits on peers: every titan_ext process group and every PP message wait ends within the job's
timeout, and the error names the rank that stopped answering (issue 26).

Why this module exists: gloo takes a process group's timeout when the group is *created*, for its
point-to-point receives; ``_set_pg_timeout`` (what TorchTitan calls with ``comm.train_timeout_seconds``
after the first step) changes the collectives' timeout but not the receives', so a frozen PP peer held
its neighbours for the 300 s of group creation. Here:

* :func:`new_group` creates our groups (control plane, Falcon's mesh groups) with an explicit timeout
  and remembers them; :func:`set_timeout` moves them all (collectives) and the PP message waits to a
  new value — TorchTitan's rule: ``comm.init_timeout_seconds`` until the first step is done, then
  ``comm.train_timeout_seconds``;
* :func:`install_p2p_timeout` wraps torch's ``schedules._batch_p2p`` (the one function through which
  every pipelining schedule, ours and torch's, sends and receives): each returned work's ``wait()``
  passes the current timeout to gloo/NCCL and turns a timeout into :class:`PeerTimeout` naming the
  peer's global rank;
* :func:`named_collective` runs a collective of ours so that a timeout says which ranks had not
  arrived (each rank marks its arrival in the default store before the collective);
* fencing: every rank publishes its host and pid in the default store (:func:`publish_identity`); a
  rank that times out on a peer that lives on its host and is *stopped* (SIGSTOP, state ``T``) kills
  it. torchrun cannot end a stopped worker with its SIGTERM and waits 30 s before its SIGKILL; a
  running peer is never touched (torchrun's SIGTERM ends it).
"""

from __future__ import annotations

import os
import signal
import socket
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch.distributed as dist

__all__ = ["PeerTimeout", "current_timeout_s", "install_p2p_timeout", "named_collective", "new_group",
           "named", "publish_identity", "set_timeout"]

_timeout_s: float | None = None  # None: the groups' own (creation) timeout
_groups: list[Any] = []  # groups created by new_group (their collectives follow set_timeout)
_arrivals: dict[str, int] = {}  # named_collective: this rank's count per name


class PeerTimeout(RuntimeError):
    """A peer rank did not answer within the timeout."""


def current_timeout_s() -> float | None:
    return _timeout_s


def _check_seconds(seconds: float, what: str) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < 1e7:
        raise ValueError(f"{what} must be a number of seconds in (0, 1e7), got {seconds!r}")
    return float(seconds)


def new_group(ranks: Sequence[int], timeout_s: float | None, **kwargs) -> Any:
    """``dist.new_group`` with ``timeout_s`` (None: the current timeout, else torch's default);
    the group then follows :func:`set_timeout`."""
    timeout_s = _timeout_s if timeout_s is None else _check_seconds(timeout_s, "timeout_s")
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    group = dist.new_group(list(ranks), **kwargs)
    if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
        _groups.append(group)
    return group


def set_timeout(seconds: float) -> None:
    """From now on, PP message waits and the collectives of our groups end after ``seconds``."""
    global _timeout_s
    _timeout_s = _check_seconds(seconds, "timeout")
    for group in _groups:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=_timeout_s), group)


class _TimedWork:
    """A p2p work whose ``wait()`` ends within the timeout and names the peer when it does not."""

    __slots__ = ("work", "peer", "kind")

    def __init__(self, work: Any, peer: int, kind: str):
        self.work, self.peer, self.kind = work, peer, kind

    def wait(self, timeout: timedelta | None = None) -> Any:
        limit = timeout or (timedelta(seconds=_timeout_s) if _timeout_s is not None else None)
        try:
            return self.work.wait(limit) if limit is not None else self.work.wait()
        except RuntimeError as e:
            if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
                raise
            seconds = limit.total_seconds() if limit is not None else float("nan")
            raise PeerTimeout(
                f"rank {dist.get_rank()}: no {self.kind} completed with rank {self.peer} within {seconds:g} s "
                f"(comm.train_timeout_seconds): rank {self.peer} stopped answering{_fence(self.peer)}") from e

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def _peer_of(op: Any) -> int:
    try:
        return dist.get_global_rank(op.group, op.group_peer) if op.group is not None else int(op.peer)
    except (RuntimeError, ValueError, AttributeError, TypeError):
        return int(getattr(op, "peer", -1))


def _timed(batch_p2p: Callable) -> Callable:
    def timed_batch_p2p(p2p_ops: list, desc: str | None = None) -> list:
        works = batch_p2p(p2p_ops, desc)
        if len(works) != len(p2p_ops):  # a coalesced batch: one work for all, name every peer
            peers = sorted({_peer_of(op) for op in p2p_ops})
            return [_TimedWork(w, peers[0] if len(peers) == 1 else peers, "message") for w in works]
        return [_TimedWork(w, _peer_of(op), "receive" if getattr(op.op, "__name__", "") == "irecv" else "send")
                for w, op in zip(works, p2p_ops)]

    timed_batch_p2p._titan_ext_timed = True  # type: ignore[attr-defined]
    timed_batch_p2p.__wrapped__ = batch_p2p  # type: ignore[attr-defined]
    return timed_batch_p2p


def install_p2p_timeout() -> None:
    """Wrap ``schedules._batch_p2p`` (idempotent; install it after any other wrapper, e.g. link-delay
    injection, so that every work it returns is timed)."""
    from torch.distributed.pipelining import schedules

    if not getattr(schedules._batch_p2p, "_titan_ext_timed", False):
        schedules._batch_p2p = _timed(schedules._batch_p2p)


def named_collective(group: Any, ranks: Sequence[int], name: str, run: Callable[[], Any]) -> Any:
    """``run()`` (a collective on ``group`` over global ``ranks``); on a timeout, raise
    :class:`PeerTimeout` naming the ranks that never reached this collective (each rank counts its
    arrivals at ``name`` in the default store first)."""
    store = _default_store()
    me = dist.get_rank()
    count = _arrivals.get(name, 0) + 1
    _arrivals[name] = count
    if store is not None:
        store.set(f"titan_ext/arrivals/{name}/{me}", str(count))
    try:
        return run()
    except RuntimeError as e:
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        missing = _behind(store, ranks, name, count)
        who = f"rank(s) {missing}" if missing else "a peer rank"
        who += "".join(_fence(r) for r in missing)
        raise PeerTimeout(f"rank {me}: {name} over ranks {list(ranks)} got no answer within "
                          f"{_timeout_s if _timeout_s is not None else 'the group timeout'} s: {who} "
                          f"stopped answering") from e


def publish_identity() -> None:
    """Put this rank's host and pid in the default store (for :func:`_fence`; idempotent)."""
    store = _default_store()
    if store is not None:
        store.set(f"titan_ext/identity/{dist.get_rank()}", f"{socket.gethostname()} {os.getpid()}")


def _fence(peer: Any) -> str:
    """Kill ``peer`` if it is a stopped process on this host (see the module docstring) → a note."""
    store, key = _default_store(), f"titan_ext/identity/{peer}"
    try:
        if store is None or not isinstance(peer, int) or not store.check([key]):
            return ""
        host, pid = store.get(key).decode().split()
        if host != socket.gethostname() or _state(int(pid)) != "T":
            return ""
        os.kill(int(pid), signal.SIGKILL)
    except (RuntimeError, ValueError, OSError):
        return ""
    return f" (its process {pid} on this host was stopped; killed it so that the job ends)"


def _state(pid: int) -> str:
    """The state letter of /proc/PID/stat (``T``: stopped), or "" when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def named(group: Any, name: str, run: Callable[[], Any]) -> Any:
    """:func:`named_collective` over all the ranks of ``group`` (None: the default group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return run()
    ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    return named_collective(group, list(ranks), name, run)


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _behind(store: Any, ranks: Sequence[int], name: str, count: int) -> list[int]:
    """Ranks whose arrival count at ``name`` is below ``count`` (never arrived this time)."""
    if store is None:
        return []
    out = []
    for r in ranks:
        key = f"titan_ext/arrivals/{name}/{r}"
        try:
            seen = int(store.get(key)) if store.check([key]) else 0
        except (RuntimeError, ValueError):
            continue
        if seen < count:
            out.append(int(r))
    return out
