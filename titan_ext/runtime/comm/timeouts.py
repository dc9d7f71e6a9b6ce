"""Bounded waits on peers: every titan_ext process group and every PP message wait ends within the job's
timeout, and the error names the rank that stopped answering.

Why this module exists: gloo takes a process group's timeout when the group is *created*, for its
point-to-point receives; ``_set_pg_timeout`` (what TorchTitan calls with ``comm.train_timeout_seconds``
after the first step) changes the collectives' timeout but not the receives', so a frozen PP peer held
its neighbours for the 300 s of group creation. Here:

* :func:`new_group` creates our groups (control plane, Falcon's mesh groups) with an explicit timeout
  and remembers them; :func:`set_timeout` moves them all (collectives) and the PP message waits to a
  new value — TorchTitan's rule: ``comm.init_timeout_seconds`` until the first step is done, then
  ``comm.train_timeout_seconds``.  A timeout is fixed per work when the work is created (ProcessGroupNCCL:
  ``WorkNCCL`` copies ``options_->timeout`` at creation; ``_set_pg_timeout`` only changes later works;
  our explicit gloo waits do the same), so a *shorter* timeout is switched to only once every rank has
  reached the switch (a host-only barrier in the default store, as TorchTitan's ``set_pg_timeouts``
  barriers before its ``_set_pg_timeout``): else a fast rank's next op, created under the short timeout,
  times out on a slow rank still legitimately busy under the long one;
* :func:`install_p2p_timeout` wraps torch's ``schedules._batch_p2p`` (the one function through which
  every pipelining schedule, ours and torch's, sends and receives).  How a PP wait is bounded depends on
  the group's backend (:func:`explicit_wait_timeout`, decided per work):

  - **gloo**: a receive keeps its group's creation timeout, so each work's ``wait()`` passes the current
    timeout and turns a timeout into :class:`PeerTimeout` naming the peer's global rank;
  - **NCCL** (and ``nccl_rules``, which models it): ``wait(timeout)`` busy-waits the host until the
    transfer completes (ProcessGroupNCCL's blocking wait), which would stop the host from running ahead
    of the device at every PP wait.  So ``wait()`` gets no timeout (it only makes the current stream
    wait); the bound is the group's timeout, which :func:`set_timeout` moves on the PP groups too
    (``_set_pg_timeout``), and NCCL's watchdog, which aborts the process after it.  A side thread
    polls the waited works (``is_completed()``, non-blocking) and, shortly before the watchdog fires,
    logs the :class:`PeerTimeout` message naming the peer and fences it (below).  ``is_completed()`` is a
    ``cudaEventQuery`` on NCCL: the side thread makes each poll under the device of the thread that
    registered the work (:func:`titan_ext.runtime.execute.device.thread_device`, which also sets the thread-local
    CUDA-graph capture mode), as ProcessGroupNCCL's watchdog takes a device guard before its queries —
    a thread that never selected a device would open a CUDA context on GPU 0 in every process;
  - **NCCL with** ``TORCH_NCCL_BLOCKING_WAIT=1``: every ``wait()`` blocks the host until the op completed
    (or timed out) and the watchdog no longer aborts, so the wait gets the explicit timeout as on gloo
    (it costs nothing more, and the timeout names the peer); :func:`install_p2p_timeout` warns once that
    the host can then no longer run ahead of the GPU (:func:`blocking_wait`);
  - a group whose backend cannot be told (``get_backend`` raises): no explicit timeout (fail closed —
    on NCCL an explicit one busy-waits the host at every PP wait; a gloo receive then keeps its group's
    creation timeout, a bound still);
* :func:`named_collective` runs a collective of ours so that a timeout says which ranks had not
  arrived (each rank marks its arrival in the default store before the collective); on a group whose
  timeout is NCCL's watchdog the same side thread watches it and names them before the watchdog fires
  (a rank frozen before the pipeline monitor's gather left its peers in that collective: nobody named
  or fenced it, and torchrun waited 30 s more on it);
* fencing: every rank publishes its host and pid in the default store (:func:`publish_identity`); a
  rank that times out on a peer that lives on its host and is *stopped* (SIGSTOP, state ``T``) kills
  it. torchrun cannot end a stopped worker with its SIGTERM and waits 30 s before its SIGKILL; a
  running peer is never touched (torchrun's SIGTERM ends it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch.distributed as dist

from ..execute.device import thread_device

__all__ = ["PeerTimeout", "blocking_wait", "current_timeout_s", "install_p2p_timeout", "named_collective",
           "fake_backend", "new_group", "named", "on_late_p2p", "publish_identity", "set_timeout",
           "explicit_wait_timeout"]

log = logging.getLogger(__name__)

_timeout_s: float | None = None  # None: the groups' own (creation) timeout
_groups: list[Any] = []  # groups created by new_group (their collectives follow set_timeout)
_p2p_groups: list[Any] = []  # groups PP messages travelled on (their timeout follows set_timeout)
_arrivals: dict[str, int] = {}  # named_collective: this rank's count per name


class PeerTimeout(RuntimeError):
    """A peer rank did not answer within the timeout."""


def current_timeout_s() -> float | None:
    return _timeout_s


def _check_seconds(seconds: float, what: str) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < 1e7:
        raise ValueError(f"{what} must be a number of seconds in (0, 1e7), got {seconds!r}")
    return float(seconds)


def fake_backend() -> bool:
    """The default process group is torch's ``fake`` backend (TorchTitan's dry-run mode): no peer
    exists, collectives return at once and leave their tensors as they were."""
    return dist.is_available() and dist.is_initialized() and str(dist.get_backend()).lower() == "fake"


def new_group(ranks: Sequence[int] | None, timeout_s: float | None, **kwargs) -> Any:
    """``dist.new_group`` over ``ranks`` (None: the world) with ``timeout_s`` (None: the current timeout,
    else torch's default); the group then follows :func:`set_timeout`.

    On TorchTitan's fake backend (``--comm.mode fake_backend``, the dry run: one process stands for one
    rank of the whole job, :mod:`titan_ext.titan.dryrun`) every group is fake too: a gloo group asked
    for by name would wait for peers that do not exist."""
    timeout_s = _timeout_s if timeout_s is None else _check_seconds(timeout_s, "timeout_s")
    if fake_backend():
        kwargs["backend"] = "fake"
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    group = dist.new_group(None if ranks is None else list(ranks), **kwargs)
    if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
        _groups.append(group)
    return group


def set_timeout(seconds: float) -> None:
    """From now on, PP message waits and the collectives of our groups end after ``seconds``: our groups'
    and the PP groups' timeouts move (on NCCL the group timeout is what bounds a PP wait).

    Works already created keep their timeout (ProcessGroupNCCL fixes it per work at creation).  A switch
    to a *shorter* timeout is collective: every rank of the job calls it at the same point (TorchTitan's
    rule: after the first step, :func:`titan_ext.titan.registry._train_timeout_after_first_step`), and
    it waits until all have arrived (:func:`_switch_barrier`, bounded by the old timeout), as TorchTitan's
    ``set_pg_timeouts`` does before its ``_set_pg_timeout`` — without it a fast rank's next collective,
    created under the short timeout, timed out on a slow rank still finishing its first step."""
    global _timeout_s
    seconds = _check_seconds(seconds, "timeout")
    if _timeout_s is not None and seconds < _timeout_s:
        _switch_barrier(_timeout_s, seconds)
    _timeout_s = seconds
    for group in (*_groups, *_p2p_groups):
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=_timeout_s), group)


def _switch_barrier(old_s: float, new_s: float) -> None:
    """Every rank of the job reached the switch to ``new_s`` (at most ``old_s`` waited; a
    :class:`PeerTimeout` names the ranks that never arrived).  Host-only, in the default store: no
    device work, no communicator (TorchTitan's ``barrier(device_ids=...)`` + ``synchronize`` would put
    a collective on the default group — under lazy init its first — and a host sync; works the device
    still has queued were created under the old timeout and keep it).  The wait runs on a private
    connection (``store.clone()``): a TCPStore client serialises its calls, so a blocking wait on the
    shared one would hold every other thread's store call (delay stamps, arrival marks) meanwhile."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return
    store = _default_store()
    if store is None:
        return
    me, world, name = dist.get_rank(), dist.get_world_size(), "timeout switch"
    count = _arrivals.get(name, 0) + 1
    _arrivals[name] = count
    store.set(f"titan_ext/arrivals/{name}/{me}", str(count))
    try:
        private = store.clone()
    except (RuntimeError, AttributeError, NotImplementedError):
        private = store
    key = f"titan_ext/timeout_switch/{count}"
    if private.add(key, 1) == world:
        private.set(key + "/all", "1")
    try:
        private.wait([key + "/all"], timedelta(seconds=old_s))
    except RuntimeError as e:  # DistStoreError: the wait timed out
        missing = _behind(store, range(world), name, count)
        who = (f"rank(s) {missing}" if missing else "a peer rank") + "".join(_fence(r) for r in missing)
        raise PeerTimeout(f"rank {me}: the switch to the {new_s:g} s timeout (after the first step) waited "
                          f"{old_s:g} s, the timeout until then, for every rank to reach it: {who} stopped "
                          f"answering") from e


def explicit_wait_timeout(group: Any) -> bool:
    """Whether a PP wait on ``group`` passes an explicit timeout: on gloo, whose receives keep the
    timeout of the group's creation; on NCCL only under :func:`blocking_wait` (every wait then blocks
    the host anyway).  On NCCL (and the ``nccl_rules`` test backend) ``wait(timeout)`` blocks the host
    until the op completes and aborts the communicator on expiry; ``wait()`` does not block, and the
    group's timeout with NCCL's watchdog bounds the op.  A group whose backend cannot be told gets none
    (fails closed: an explicit timeout on NCCL would busy-wait the host at every PP wait)."""
    try:
        backend = str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError, AttributeError, TypeError):
        return False
    if backend == dist.Backend.GLOO:
        return True
    # "nccl", or a per-device list ("cuda:nccl,cpu:gloo", TorchTitan's enable_cpu_backend): PP tensors are CUDA
    nccl = any(part.rpartition(":")[2] == "nccl" for part in backend.split(","))
    return nccl and blocking_wait()


#: ProcessGroupNCCL's blocking-wait switch and its deprecated alias (``TORCH_NCCL_BLOCKING_WAIT`` in
#: ProcessGroupNCCL.hpp), read as c10d's ``getCvarBool`` (Utils.hpp) reads them: the first one set wins,
#: true is 1/y/yes/t/true in any case
BLOCKING_WAIT_VARS = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")


def blocking_wait() -> bool:
    """Whether ProcessGroupNCCL runs with blocking wait (``TORCH_NCCL_BLOCKING_WAIT=1``): ``Work.wait()``
    then busy-waits the host until the op completed or its timeout passed (``WorkNCCL::synchronize``),
    and the watchdog leaves timeouts to that wait instead of aborting the process."""
    for var in BLOCKING_WAIT_VARS:
        value = os.environ.get(var)
        if value is not None:
            return value.lower() in ("1", "y", "yes", "t", "true")
    return False


_warned_blocking_wait: list[bool] = []


def _warn_blocking_wait() -> None:
    """One line per process when :func:`blocking_wait` is on (a warning, not a refusal: blocking wait is
    a legitimate way to debug a hang — a timeout raises in ``wait()`` instead of aborting — but a job
    left with it trains with its GPUs idle at every pipeline receive, which nothing else would show)."""
    if _warned_blocking_wait or not blocking_wait():
        return
    _warned_blocking_wait.append(True)
    var = next(v for v in BLOCKING_WAIT_VARS if os.environ.get(v) is not None)
    log.warning("titan_ext: %s=%s: every NCCL wait, each pipeline receive included, blocks the host until the "
                "data arrived, so the host cannot run ahead and the GPU idles at every PP wait (and NCCL's "
                "watchdog no longer aborts on a timeout: the wait raises); unset it for training",
                var, os.environ[var])


def _remember_p2p_group(group: Any) -> None:
    """A group that carries PP messages follows :func:`set_timeout` from now on."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    if any(g is group for g in _p2p_groups):
        return
    _p2p_groups.append(group)
    if _timeout_s is not None:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=_timeout_s), group)


class _TimedWork:
    """A p2p work whose ``wait()`` is bounded by the timeout and names the peer when it is not (on gloo by
    an explicit wait timeout; elsewhere by the group's timeout, :func:`explicit_wait_timeout`)."""

    __slots__ = ("work", "peer", "kind", "explicit", "limit_s")

    def __init__(self, work: Any, peer: Any, kind: str, explicit: bool):
        self.work, self.peer, self.kind, self.explicit = work, peer, kind, explicit
        self.limit_s = _timeout_s  # fixed at creation, as ProcessGroupNCCL fixes a work's timeout

    def wait(self, timeout: timedelta | None = None) -> Any:
        if not self.explicit and timeout is None:
            if self.limit_s is not None:
                _watch(self)
            return self.work.wait()
        limit = timeout or (timedelta(seconds=self.limit_s) if self.limit_s is not None else None)
        try:
            return self.work.wait(limit) if limit is not None else self.work.wait()
        except RuntimeError as e:
            if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
                raise
            raise PeerTimeout(self.note(limit.total_seconds() if limit is not None else float("nan"))) from e

    def done(self) -> bool:
        """For the watch: completed (or failed: the backend reports it), without blocking."""
        try:
            return self.work.is_completed()
        except Exception:  # noqa: BLE001 - failed: the backend reports it
            return True

    def note(self, waited: float) -> str:
        """The line naming the peer that stopped answering (and fencing it): the timeout's, the watch's."""
        return (f"rank {dist.get_rank()}: no {self.kind} completed with rank {self.peer} within {waited:g} s"
                f"{_limit()}: rank {self.peer} stopped answering{_fence(self.peer)}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


class _Pending:
    """A host call in progress that NCCL's watchdog, not an error, would end: watched like a PP wait
    (:func:`_watching`), its timeout fixed when it began; done once the call returned."""

    __slots__ = ("limit_s", "finished")

    def __init__(self) -> None:
        self.limit_s, self.finished = _timeout_s, False

    def done(self) -> bool:
        return self.finished


@contextlib.contextmanager
def _watching(pending: _Pending | None):
    """Watch ``pending`` (None: nothing) while the body runs."""
    if pending is not None:
        _watch(pending)
    try:
        yield
    finally:
        if pending is not None:
            pending.finished = True


class _PendingCollective(_Pending):
    """A :func:`named_collective` in progress on a group whose timeout is NCCL's watchdog (no error is
    raised there: the process is aborted), watched like a PP wait so that the ranks that never arrived
    are named, and a stopped one fenced, before the watchdog fires."""

    __slots__ = ("ranks", "name", "count")

    def __init__(self, ranks: Sequence[int], name: str, count: int):
        super().__init__()
        self.ranks, self.name, self.count = list(ranks), name, count

    def note(self, waited: float) -> str:
        return _collective_note(self.ranks, self.name, self.count, waited)


def _collective_note(ranks: Sequence[int], name: str, count: int, waited: float | None) -> str:
    """The line naming the ranks that never reached ``name``'s ``count``-th arrival, each stopped one on
    this host fenced: the timeout's, the watch's (``waited`` None: the group's own timeout)."""
    missing = _behind(_default_store(), ranks, name, count)
    who = (f"rank(s) {missing}" if missing else "a peer rank") + "".join(_fence(r) for r in missing)
    within = f"{waited:g} s{_limit()}" if waited is not None else "the group's timeout"
    return (f"rank {dist.get_rank()}: {name} over ranks {list(ranks)} got no answer within {within}: "
            f"{who} stopped answering")


def _limit() -> str:
    return f" (comm.train_timeout_seconds = {_timeout_s:g} s)" if _timeout_s is not None else " (the group's timeout)"


def _peer_of(op: Any) -> int:
    try:
        return dist.get_global_rank(op.group, op.group_peer) if op.group is not None else int(op.peer)
    except (RuntimeError, ValueError, AttributeError, TypeError):
        return int(getattr(op, "peer", -1))


class _PendingIssue(_Pending):
    """A PP op being *issued* on a group whose timeout is NCCL's watchdog: under lazy init (no
    ``device_id``, TorchTitan's default) NCCL creates a communicator at the first op that needs it and
    blocks the host in ``ncclCommInitRank`` until every rank of it joined — before any work exists for
    the watch to poll.  A peer frozen before its first PP op then held this rank inside the issue, unnamed
    and unfenced, until the watchdog (torch <= 2.11 puts even a lone receive through ``batch_isend_irecv``,
    whose communicator is the group's).  Watched like a PP wait; done once the issue returned."""

    __slots__ = ("peers",)

    def __init__(self, peers: list[int]):
        super().__init__()
        self.peers = peers

    def note(self, waited: float) -> str:
        who = "".join(_fence(p) for p in self.peers)
        return (f"rank {dist.get_rank()}: issuing a PP op with rank(s) {self.peers} did not return within "
                f"{waited:g} s{_limit()} (NCCL creates a communicator at its first op and blocks the host "
                f"until every rank of it joined): rank(s) {self.peers} stopped answering{who}")


def _peers(p2p_ops: list) -> list[int]:
    return sorted({_peer_of(op) for op in p2p_ops})


def _timed(batch_p2p: Callable) -> Callable:
    def timed_batch_p2p(p2p_ops: list, desc: str | None = None) -> list:
        if not p2p_ops:
            return batch_p2p(p2p_ops, desc)
        explicit = explicit_wait_timeout(p2p_ops[0].group)
        # NCCL: the issue itself may create a communicator and block the host (_PendingIssue)
        with _watching(_PendingIssue(_peers(p2p_ops)) if not explicit and _timeout_s is not None else None):
            works = batch_p2p(p2p_ops, desc)
        _remember_p2p_group(p2p_ops[0].group)
        if len(works) != len(p2p_ops):  # a coalesced batch: one work for all, name every peer
            peers = _peers(p2p_ops)
            return [_TimedWork(w, peers[0] if len(peers) == 1 else peers, "message", explicit) for w in works]
        return [_TimedWork(w, _peer_of(op), "receive" if getattr(op.op, "__name__", "") == "irecv" else "send",
                           explicit) for w, op in zip(works, p2p_ops)]

    timed_batch_p2p._titan_ext_timed = True  # type: ignore[attr-defined]
    timed_batch_p2p.__wrapped__ = batch_p2p  # type: ignore[attr-defined]
    return timed_batch_p2p


#: the watch names a stopped peer this long before the group's timeout (NCCL's watchdog) ends the process
_WATCH_LEAD_S = 5.0
#: (since, _TimedWork | _Pending, device context factory): NCCL-side waits not done yet
_watched: list[tuple[float, Any, Callable[[], Any]]] = []
_watch_lock = threading.Lock()
_watcher: list[threading.Thread] = []


#: step-level failover of an NCCL PP group (``runtime/comm/delegate/schedule.py``, ``StepFailover``): called with a late PP
#: wait before NCCL's watchdog would end the process; a hook that returns True takes it over (it aborts
#: the PP communicator, so the wait raises and the step is re-run on the delegates): no fencing then
_late_p2p_hooks: list[Callable[[Any], bool]] = []


def on_late_p2p(hook: Callable[[Any], bool]) -> Callable[[], None]:
    """Register ``hook(work) -> bool`` for late PP waits (above); returns its remover."""
    _late_p2p_hooks.append(hook)

    def remove() -> None:
        with contextlib.suppress(ValueError):
            _late_p2p_hooks.remove(hook)
    return remove


def _taken_over(work: Any) -> bool:
    for hook in list(_late_p2p_hooks) if isinstance(work, _TimedWork) else ():
        try:
            if hook(work):
                return True
        except Exception:  # noqa: BLE001 - the watch never dies of a hook
            continue
    return False


def _watch(work: Any) -> None:
    """Poll ``work`` (a PP wait or a named collective) from a side thread (``done()`` does not block); past
    the lead time before the timeout, log the peer that stopped answering and fence it (a stopped process
    on this host): NCCL's watchdog then ends this process, and the launcher no longer waits on a peer
    that cannot die.  The registering thread's device (:func:`~titan_ext.runtime.execute.device.thread_device`,
    captured here, per work: cheap, and right whichever thread registers) is entered around each of the
    side thread's polls — ``is_completed()`` is a ``cudaEventQuery`` on NCCL."""
    device = thread_device()
    with _watch_lock:
        _watched.append((time.monotonic(), work, device))
        if not _watcher:
            _watcher.append(threading.Thread(target=_watch_loop, daemon=True, name="titan_ext-pp-watch"))
            _watcher[0].start()


def _done(work: Any, device: Callable[[], Any]) -> bool:
    """``work.done()`` under its registering thread's device (a failure counts as done: the backend
    reports it to the waiter; the watch itself never dies of it)."""
    try:
        with device():
            return work.done()
    except Exception:  # noqa: BLE001 - see above
        return True


def _watch_loop() -> None:
    while True:
        time.sleep(0.25)
        now, late = time.monotonic(), []
        with _watch_lock:
            keep = []
            for since, work, device in _watched:
                limit = getattr(work, "limit_s", None) or _timeout_s or 0.0  # a PP wait's: fixed at creation
                if _done(work, device):
                    continue
                if limit and now - since > max(0.5 * limit, limit - _WATCH_LEAD_S):
                    late.append((now - since, work))
                else:
                    keep.append((since, work, device))
            _watched[:] = keep
        for waited, work in late:
            if _taken_over(work):
                print(f"rank {dist.get_rank()}: no {work.kind} completed with rank {work.peer} within "
                      f"{round(waited)} s{_limit()}: the PP group's NCCL path fails over to the delegates",
                      file=sys.stderr, flush=True)
                continue
            print(work.note(round(waited)), file=sys.stderr, flush=True)


def install_p2p_timeout() -> None:
    """Wrap ``schedules._batch_p2p`` (idempotent; install it after any other wrapper, e.g. link-delay
    injection, so that every work it returns is timed)."""
    from torch.distributed.pipelining import schedules

    _warn_blocking_wait()
    if not getattr(schedules._batch_p2p, "_titan_ext_timed", False):
        schedules._batch_p2p = _timed(schedules._batch_p2p)


def named_collective(group: Any, ranks: Sequence[int], name: str, run: Callable[[], Any]) -> Any:
    """``run()`` (a collective on ``group`` over global ``ranks``); on a timeout, raise
    :class:`PeerTimeout` naming the ranks that never reached this collective (each rank counts its
    arrivals at ``name`` in the default store first).  On a group whose timeout raises nothing (NCCL:
    its watchdog aborts the process) the watch names them, and fences a stopped one, shortly before."""
    store = _default_store()
    me = dist.get_rank()
    count = _arrivals.get(name, 0) + 1
    _arrivals[name] = count
    if store is not None:
        store.set(f"titan_ext/arrivals/{name}/{me}", str(count))
    watched = _timeout_s is not None and not explicit_wait_timeout(group)  # NCCL: the watchdog, no error
    try:
        with _watching(_PendingCollective(ranks, name, count) if watched else None):
            return run()
    except RuntimeError as e:
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        raise PeerTimeout(_collective_note(ranks, name, count, _timeout_s)) from e


def publish_identity() -> None:
    """Put this rank's host and pid in the default store (for :func:`_fence`; idempotent)."""
    store = None if fake_backend() else _default_store()  # the fake backend's store stores nothing
    if store is not None:
        store.set(f"titan_ext/identity/{dist.get_rank()}", f"{socket.gethostname()} {os.getpid()}")


def _fence(peer: Any) -> str:
    """Kill ``peer`` if it is a stopped process on this host (see the module docstring) → a note."""
    store, key = _default_store(), f"titan_ext/identity/{peer}"
    try:
        if store is None or not isinstance(peer, int) or not store.check([key]):
            return ""
        host, pid = store.get(key).decode().split()
        if host != socket.gethostname() or _state(int(pid)) != "T" or not _same_job(int(pid)):
            return ""
        os.kill(int(pid), signal.SIGKILL)
    except (RuntimeError, ValueError, OSError):
        return ""
    return f" (its process {pid} on this host was stopped; killed it so that the job ends)"


#: what makes a process a rank of this job: the launcher's run id and rendezvous address, as set here
_JOB_KEYS = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")


def _same_job(pid: int, environ=os.environ) -> bool:
    """``pid`` is a process of this user and a sibling rank: the same parent (torchrun's agent on this
    host, a test's spawner), or the same values of :data:`_JOB_KEYS` in its environment. The store is
    unauthenticated: a pid published there is never trusted alone. False when it cannot be read."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return False
        if _ppid(pid) == os.getppid():
            return True
        with open(f"/proc/{pid}/environ", "rb") as f:
            theirs = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except (OSError, ValueError):
        return False
    mine = {k: environ[k] for k in _JOB_KEYS if environ.get(k)}
    return bool(mine) and all(theirs.get(k.encode()) == v.encode() for k, v in mine.items())


def _ppid(pid: int) -> int:
    """The parent of ``pid`` (``/proc/PID/stat`` field 4)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


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
