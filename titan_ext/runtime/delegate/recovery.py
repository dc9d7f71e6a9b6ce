"""Killed delegate: exact fallback to the direct path, background respawn, return (docs/delegate.md).

A *link* is one lane of one channel on one rank, across respawns of its delegate.  When the delegate
of a link dies (SIGKILL, a crash, or its peer delegate dying, which closes their Gloo pair):

1. **Detection** — on each rank a :class:`Supervisor` thread sleeps in ``select`` on the pidfds of its
   delegates (the kernel's process sentinel: no polling, no heartbeat traffic), so the rank whose
   delegate died learns it at once.  A *frozen* delegate (SIGSTOP, or a hang that stops its
   interpreter) is found by its heartbeat: a word of its ring it increments every ``HEARTBEAT_S``;
   unchanged for ``pool.heartbeat_timeout_s``, the delegate is SIGKILLed and recovered like a dead one
   (issue 26).  The other rank learns it twice over: its own delegate of the lane
   fails as soon as the pair's connection closes (both delegates of a lane always have a Gloo receive
   posted: data on the recv side, acknowledgements on the send side), and the detecting rank also
   declares the link down in the job's TCPStore (a per-rank "inbox" counter the supervisor reads every
   ``TICK_S``), which covers a delegate that is not inside Gloo at that moment.
2. **Agreement** — both ranks SIGKILL and reap their own delegate of the link, so the ring contents are
   final.  The receiver takes every complete (READY) message left in its ring and publishes ``first``,
   the lowest sequence number of the link that no ring delivered, under ``.../e<epoch>/first``.  The
   supervisor never blocks on its peer: it declares and reaps every dead link and publishes every
   receiver's ``first`` before it polls the store for the ``first`` its senders need (one side's
   delegates killed take down two links of the rank pair at once; a blocking wait on one would let
   both supervisors wait for each other).
3. **Replay, nothing lost or repeated** — the sender keeps a reference to every message it handed to
   the delegate until the peer's recv delegate acknowledges it (it acknowledges after the message is
   READY in the receiver's ring, so acknowledged ⇒ delivered).  It re-sends exactly the kept messages
   with ``seq >= first`` on the direct path; everything below ``first`` was delivered.
4. **Direct period** — every message of the link then goes over the direct group, each preceded by a
   one-word *route marker*; both carry tags unique to (direction, seq) (:func:`tag`), so they match
   whatever the order of posting and cannot collide with the schedule's own P2P (tag 0).
5. **Respawn and return** — both ranks start a new delegate with a fresh ring for epoch+1 in the
   background.  The sender switches back at the first message it sends once its new delegate is
   connected (which implies the peer's is): that message's route marker says DELEGATE.  The receiver
   reads route markers in sequence order, so it learns the switch point exactly, whatever order its
   receives are waited in.
"""

from __future__ import annotations

import collections
import os
import select
import signal
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .pool import DelegatePool, _Lane

UP, RECOVERING, DOWN = "up", "recovering", "down"
DIRECT, DELEGATE = 0, 1      # route markers
TAG_BASE = 1 << 20           # above any tag the schedules use
TICK_S = 0.25                # supervisor: store inbox poll period (pidfds wake it at once)
AGREE_POLL_S = 0.005         # supervisor: store poll period while a sender awaits its peer's replay point


def tag(direction: str, seq: int, data: bool) -> int:
    """Direct-path tag of message ``seq``'s route marker (data=False) or payload (data=True)."""
    return TAG_BASE + 4 * seq + 2 * (direction == "B") + int(data)


class LinkDown(Exception):
    """Internal: the link's delegate is gone or being replaced; take the fallback path."""


class Link:
    """One lane of one channel on this rank, across respawns of its delegate."""

    def __init__(self, channel, index: int, role: str, stride: int, lane: "_Lane"):
        self.channel, self.index, self.role, self.stride = channel, index, role, stride
        self.lane = lane                    # the delegate in use (UP), or the dead one (DOWN)
        self.spare: _Lane | None = None     # respawned delegate, not yet in use
        self.state = UP
        self.mutex = threading.Lock()       # send: ring write + keep vs. the replay snapshot; recv: routes
        self.retained: collections.deque = collections.deque()  # send: (seq, tensor) not yet acknowledged
        self.next_ring_seq = index          # recv: lowest seq of this link no ring has delivered yet
        self.windows: list[list] = []       # recv: [lo, hi) seqs on the direct path (hi None: open)
        self.route_next: int | None = None  # recv: next seq of the open window whose marker is unread
        self.routes: dict[int, int] = {}    # recv: seq -> DIRECT (marker read, payload not yet)
        self.error: str | None = None       # unusable (peer gone): operations raise DelegateError

    @property
    def peer(self) -> int:
        return self.channel.dst if self.role == "send" else self.channel.src

    def in_window(self, seq: int) -> bool:
        return any(lo <= seq and (hi is None or seq < hi) for lo, hi in self.windows)

    def keep(self, seq: int, tensor: torch.Tensor, acked: int) -> None:
        """Sender: keep message ``seq`` until acknowledged; drop what ``acked`` covers."""
        while self.retained and self.retained[0][0] <= acked:
            self.retained.popleft()
        self.retained.append((seq, tensor))


def lane_dead(lane: "_Lane") -> bool:
    return lane.proc is None or lane.proc.poll() is not None


class Supervisor(threading.Thread):
    """Watches one pool's delegates and runs the recovery protocol (module docstring) for it.

    It also starts the respawned delegates: PR_SET_PDEATHSIG follows the thread that forked, so this
    thread lives until the pool has stopped every delegate (``released``)."""

    def __init__(self, pool: "DelegatePool", host: str, port: int):
        super().__init__(daemon=True, name=f"titan_ext-delegate-supervisor-{pool.pool_id}")
        self.pool = pool
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=pool.timeout_s))
        self.root = f"titanx/{pool.pool_id}/"
        self._inbox_seen = 0
        self._agreeing: dict[Link, tuple[float, float]] = {}   # send links awaiting ``first``: (t0, deadline)
        self._causes: dict[Link, str] = {}   # why a link went down, when not a plain death
        self.error: str | None = None
        self.announced = threading.Event()   # the peers were told this pool is closing
        self.released = threading.Event()    # the pool stopped its delegates: this thread may end

    # --- keys ---------------------------------------------------------------------------------
    def _key(self, lane: "_Lane", what: str) -> str:
        return f"{self.pool.lane_prefix(lane.channel, lane.index, lane.epoch)}{what}"

    def _inbox(self, rank: int) -> str:
        return f"{self.root}inbox/{rank}"

    def _closed_key(self, rank: int) -> str:
        return f"{self.root}closed/{rank}"

    # --- loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while not self.pool._closed:
                self._tick()
        except Exception as exc:  # noqa: BLE001 - the store is gone (job ending) or a bug: stop watching
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            try:
                self.store.set(self._closed_key(self.pool.rank), "1")
            except Exception:  # noqa: BLE001 - the store may be gone already
                pass
            self.announced.set()
            self.released.wait()

    def _tick(self) -> None:
        links = [lk for lk in self.pool.links() if lk.state == UP and lk.error is None]
        fds = [lk.lane.pidfd for lk in links if lk.lane.pidfd is not None]
        # while a sender waits for its peer's replay point, poll the store for it every few ms
        wait_s = AGREE_POLL_S if self._agreeing else TICK_S
        if fds:
            select.select(fds, [], [], wait_s)
        else:
            time.sleep(wait_s)
        if self.pool._closed:
            return
        declared = self._declared_by_peers(links)
        down = []
        for lk in links:
            if lane_dead(lk.lane) or lk in declared:
                down.append(lk)
            elif lk.lane.frozen(self.pool.heartbeat_timeout_s):  # SIGSTOP or hung: like a dead one
                self._causes[lk] = f"frozen: no heartbeat for {self.pool.heartbeat_timeout_s:.0f} s"
                down.append(lk)
        for lk in down:  # every dead link is declared and reaped before any agreement is awaited
            self._start_recovery(lk)
        for lk in list(self._agreeing):
            self._try_agree(lk)

    def _declared_by_peers(self, links: list[Link]) -> list[Link]:
        seen = int(self.store.add(self._inbox(self.pool.rank), 0))
        if seen == self._inbox_seen:
            return []
        self._inbox_seen = seen
        return [lk for lk in links if self.store.check([self._key(lk.lane, "down")])]

    # --- recovery -----------------------------------------------------------------------------
    def _start_recovery(self, link: Link) -> None:
        """Steps 1-2 for one link; never waits on the peer.  A receiver publishes ``first`` at once; a
        sender joins ``_agreeing`` until the peer's ``first`` is in the store.  (A blocking wait here
        deadlocks when two links die together: each rank's supervisor would wait, on its send link, for
        the ``first`` its peer publishes only after its own send link's wait.)"""
        t0 = time.monotonic()
        link.state = RECOVERING
        lane = link.lane
        self.store.set(self._key(lane, "down"), "1")
        self.store.add(self._inbox(link.peer), 1)
        kill_lane(lane)
        if self.store.check([self._closed_key(link.peer)]):
            link.error = f"{lane.describe()} is gone and rank {link.peer} closed its delegate pool"
            link.state = DOWN
            return
        if link.role == "send":
            self._agreeing[link] = (t0, t0 + self.pool.timeout_s)
            return
        first = self.pool._recover_recv(link)
        self.store.set(self._key(lane, "first"), str(first))
        self._fell_back(link, t0, first, 0)

    def _try_agree(self, link: Link) -> None:
        """Sender, step 3: once the peer published ``first``, replay from it; past ``timeout_s`` the link
        is unusable (a clean stop on it)."""
        t0, deadline = self._agreeing[link]
        key = self._key(link.lane, "first")
        if not self.store.check([key]):
            if time.monotonic() > deadline:
                del self._agreeing[link]
                link.error = (f"{link.lane.describe()} died and rank {link.peer} did not agree on a replay "
                              f"point within {self.pool.timeout_s:.0f} s")
                link.state = DOWN
            return
        del self._agreeing[link]
        first = int(self.store.get(key))
        self._fell_back(link, t0, first, self.pool._recover_send(link, first))

    def _fell_back(self, link: Link, t0: float, first: int, replayed: int) -> None:
        """The link is on the direct path: log it and start its new delegate (step 5)."""
        lane = link.lane
        self.pool._log_event(link, "fallback", epoch=lane.epoch, first_undelivered=first,
                             replayed=replayed, recovery_ms=1e3 * (time.monotonic() - t0),
                             exit_code=lane.proc.returncode if lane.proc else None,
                             cause=self._causes.pop(link, "died"))
        try:
            self.pool._respawn(link)
        except Exception as exc:  # noqa: BLE001 - the lane stays on the direct path (correct, slower)
            self.pool._log_event(link, "respawn_failed", epoch=lane.epoch + 1, error=f"{type(exc).__name__}: {exc}")


def kill_lane(lane: "_Lane") -> None:
    """SIGKILL and reap a delegate (it may be dead already); its ring is final afterwards."""
    proc = lane.proc
    if proc is not None and proc.poll() is None:
        try:
            proc.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    if lane.pidfd is not None:
        os.close(lane.pidfd)
        lane.pidfd = None
