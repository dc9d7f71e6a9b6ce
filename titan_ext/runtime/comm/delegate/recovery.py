"""Killed delegate: exact fallback to the direct path, background respawn, return (docs/delegate.md).

A *link* is one lane of one channel on one rank, across respawns of its delegate.  When the delegate
of a link dies (SIGKILL, a crash, or its peer delegate dying, which closes their Gloo pair):

1. **Detection** — on each rank a :class:`Supervisor` thread sleeps in ``select`` on the pidfds of its
   delegates (the kernel's process sentinel: no polling, no heartbeat traffic), so the rank whose
   delegate died learns it at once.  A *frozen* delegate (SIGSTOP, or a hang that stops its
   interpreter) is found by its heartbeat: a word of its ring it increments every ``HEARTBEAT_S``;
   unchanged for ``pool.heartbeat_timeout_s``, the delegate is SIGKILLed and recovered like a dead one.
   The other rank learns it twice over: its own delegate of the lane
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

import select
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from . import ring as R
from .lanes import Lane, LaneProcesses, kill_lane, lane_dead
from .link import DELEGATE, DIRECT, DOWN, RECOVERING, UP, DelegateError, Link, LinkDown, silent_peer, tag

__all__ = ["Recovery", "Supervisor"]

TICK_S = 0.25                # supervisor: store inbox poll period (pidfds wake it at once)
AGREE_POLL_S = 0.005         # supervisor: store poll period while a sender awaits its peer's replay point


class DirectSend:
    """A fallback send on the direct path: route marker + payload (both kept alive until waited)."""

    def __init__(self, works: list, keep: list):
        self.works, self.keep = works, keep

    def wait(self, timeout=None) -> bool:  # noqa: ARG002
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class Recovery:
    """Lane health and the killed-delegate protocol of one pool; owns the fallback's state (on/off, the
    direct group, the supervisor, in-flight direct sends, the event log).

    The send path and the receive matcher ask it whether a lane is usable (:meth:`lane_ok`,
    :meth:`wait_slot`) and hand it what happens on the direct path; the :class:`Supervisor` drives the
    recovery steps (:meth:`recover_recv`, :meth:`recover_send`, :meth:`respawn`).  ``receiver`` (the
    pool's receive matcher, set by the pool) takes what a dead ring still holds."""

    def __init__(self, rank: int, procs: LaneProcesses, links: Callable[[], list[Link]], lock):
        self.rank, self.procs, self.links, self.lock = rank, procs, links, lock
        self.receiver = None
        self.enabled = False            # enable(): a dead delegate → direct path, respawn, return
        self.group = None               # direct group of the fallback path
        self.supervisor: Supervisor | None = None
        self.orphans: list[DirectSend] = []   # replays and switch markers nobody waits on
        self.events: list[dict] = []

    # --- what the supervisor reads ---------------------------------------------------------------
    @property
    def pool_id(self) -> str:
        return self.procs.pool_id

    @property
    def timeout_s(self) -> float:
        return self.procs.timeout_s

    @property
    def heartbeat_timeout_s(self) -> float:
        return self.procs.heartbeat_timeout_s

    @property
    def closed(self) -> bool:
        return self.procs.closed

    def lane_prefix(self, c, index: int, epoch: int) -> str:
        return self.procs.prefix(c, index, epoch)

    # --- fallback on/off ---------------------------------------------------------------------------
    def enable(self, group=None) -> None:
        if self.enabled:
            return
        self.group, self.enabled = group, True
        self.supervisor = Supervisor(self, self.procs.store_host, self.procs.store_port)
        self.supervisor.start()

    def stop(self) -> None:
        """Before the pool stops its delegates: the peers were told this pool is closing."""
        if self.supervisor is not None:
            self.supervisor.announced.wait(timeout=2.0)

    def release(self) -> None:
        """After: respawned delegates are the supervisor's children (PR_SET_PDEATHSIG): end it last."""
        if self.supervisor is not None:
            self.supervisor.released.set()
            self.supervisor.join(timeout=2.0)
        self.orphans.clear()

    # --- lane health -------------------------------------------------------------------------------
    def check(self, link: Link) -> None:
        """Raise :class:`DelegateError` if the link is unusable: with fallback, only when its peer did not
        take part in the recovery; without, when its delegate died, failed or froze."""
        if link.error:
            raise DelegateError(link.error)
        if not self.enabled:
            self.procs.check(link.lane)

    def lane_ok(self, link: Link, lane: Lane) -> None:
        """Raise LinkDown (fallback: the supervisor takes over) or DelegateError (no fallback)."""
        if not self.enabled:
            self.procs.check(lane)
            return
        if link.error:
            raise DelegateError(link.error)
        if link.state != UP or link.lane is not lane:
            raise LinkDown
        if lane.ring.region.load(R.CTRL_ERROR) or lane_dead(lane):
            sup = self.supervisor
            if not sup.is_alive() or sup.announced.is_set():
                raise DelegateError(f"{lane.describe()} died and the delegate supervisor has stopped "
                                    f"({sup.error or 'pool closing'})")
            time.sleep(0.01)  # dead: the supervisor notices within a tick and changes the state
            raise LinkDown

    def wait_slot(self, link: Link, lane: Lane, i: int, want: int, timeout_s: float, what: str,
                  raise_on_timeout: bool = True) -> bool:
        """Block until slot ``i`` of the lane's ring is ``want`` (True), checking the lane's health
        meanwhile; after ``timeout_s`` raise, or return False (``raise_on_timeout=False``: the caller
        re-checks, e.g. whether another thread took the message meanwhile)."""
        deadline = time.monotonic() + timeout_s
        sleep_us = 50 if self.procs.layer is not None else 1000
        while True:
            rc = lane.ring.wait_state(i, want, min(0.2, max(deadline - time.monotonic(), 0.0)), R.CTRL_ERROR,
                                      sleep_us)
            if rc == 0:
                return True
            self.lane_ok(link, lane)
            if self.procs.closed:
                raise DelegateError("delegate pool closed while waiting")
            if time.monotonic() > deadline:
                if not raise_on_timeout:
                    return False
                raise silent_peer(link.peer, what, timeout_s, lane)

    # --- sender side -------------------------------------------------------------------------------
    def spare_ready(self, link: Link) -> bool:
        spare = link.spare
        return spare is not None and spare.ring.region.load(R.CTRL_DELEGATE_STATE) == 1 and not lane_dead(spare)

    def direct_send(self, link: Link, tensor: torch.Tensor | None, seq: int, route: int) -> DirectSend:
        marker = torch.tensor([route], dtype=torch.int64)
        d = link.channel.direction
        works, keep = [dist.isend(marker, link.peer, group=self.group, tag=tag(d, seq, False))], [marker]
        if route == DIRECT:
            data = tensor if tensor.is_contiguous() else tensor.contiguous()
            works.append(dist.isend(data, link.peer, group=self.group, tag=tag(d, seq, True)))
            keep.append(data)
        return DirectSend(works, keep)

    def orphan(self, handle: DirectSend) -> DirectSend:
        """Keep a direct send alive until it completes (its caller need not wait on it)."""
        with self.lock:
            self.orphans = [h for h in self.orphans if not h.is_completed()] + [handle]
        return handle

    def send_down(self, link: Link, tensor: torch.Tensor, seq: int) -> DirectSend:
        """Sender, link DOWN: message ``seq`` goes on the direct path (caller holds link.mutex)."""
        return self.orphan(self.direct_send(link, tensor, seq, DIRECT))

    def switch_send(self, link: Link, seq: int) -> None:
        """Sender, link DOWN, new delegate connected: message ``seq`` and later go through it (caller holds
        link.mutex)."""
        self.orphan(self.direct_send(link, None, seq, DELEGATE))
        link.lane, link.spare, link.state = link.spare, None, UP
        self.log_event(link, "returned", epoch=link.lane.epoch, from_seq=seq)

    def recover_send(self, link: Link, first: int) -> int:
        """Sender side of a recovery: replay the kept messages the receiver's ring did not deliver."""
        with link.mutex:  # a send in progress finishes (ring write + keep) or aborts first
            replay = [(s, t) for s, t in link.retained if s >= first]
            link.retained.clear()
            link.pending.clear()   # queued for a full ring: kept (retained) like the rest, replayed above
            link.state = DOWN
            for s, t in replay:
                self.orphan(self.direct_send(link, t, s, DIRECT))
        return len(replay)

    # --- receiver side -----------------------------------------------------------------------------
    def recover_recv(self, link: Link) -> int:
        """Receiver side: take the complete messages left in the dead ring; open the direct window."""
        with self.lock:
            self.receiver.take_ready(link)
            first = link.next_ring_seq
            link.windows.append([first, None])
            link.route_next = first
            link.state = DOWN
        return first

    def recv_direct(self, link: Link, h) -> bool:
        """Receive ``h`` in the link's direct window; False if the sender switched back at or below it."""
        if self.route(link, h.seq) is None:
            return False
        self.receiver.forget(h.key, h.seq)
        t = h.tensor if h.tensor.is_contiguous() else torch.empty_like(h.tensor)
        with torch.no_grad():
            dist.irecv(t, link.peer, group=self.group, tag=tag(link.channel.direction, h.seq, True)).wait()
            if t is not h.tensor:
                h.tensor.copy_(t)
        with self.lock:
            link.routes.pop(h.seq, None)
            self.receiver.finish(h)
        return True

    def route(self, link: Link, seq: int) -> int | None:
        """DIRECT if message ``seq`` travels on the direct path, None if the sender switched back to a new
        delegate at or below ``seq``.  Route markers are read in sequence order, so the switch point is
        found whatever order the receives are waited in."""
        with link.mutex:
            while True:
                with self.lock:
                    if seq in link.routes:
                        return DIRECT
                    if not link.in_window(seq):
                        return None
                    s = link.route_next
                marker = torch.empty(1, dtype=torch.int64)
                dist.irecv(marker, link.peer, group=self.group, tag=tag(link.channel.direction, s, False)).wait()
                with self.lock:
                    if int(marker[0]) == DIRECT:
                        link.routes[s] = DIRECT
                        link.route_next = s + link.stride
                    else:
                        self.switch_recv(link, s)

    def switch_recv(self, link: Link, seq: int) -> None:
        """Receiver: the sender's route marker says ``seq`` and later come from the new delegate."""
        if link.spare is None:
            raise DelegateError(f"rank {link.peer} switched lane {link.index} back at {seq} but no new "
                                f"delegate was started here")
        link.windows[-1][1] = seq
        link.lane, link.spare, link.state = link.spare, None, UP
        link.next_ring_seq, link.route_next = seq, None
        self.log_event(link, "returned", epoch=link.lane.epoch, from_seq=seq)

    # --- both --------------------------------------------------------------------------------------
    def respawn(self, link: Link) -> None:
        old = link.lane
        spare = self.procs.new_lane(old.channel, old.index, old.role, old.epoch + 1)
        with self.lock:  # in place before its process exists: the peer can only switch once it runs
            link.spare = spare
        self.procs.launch(spare)
        self.log_event(link, "respawned", epoch=spare.epoch, pid=spare.proc.pid)

    def log_event(self, link: Link, event: str, **info) -> None:
        c = link.channel
        with self.lock:
            self.events.append({"event": event, "kind": f"{link.role}-{c.direction}", "src": c.src,
                                "dst": c.dst, "lane": link.index, "time": time.time(), **info})


class Supervisor(threading.Thread):
    """Watches one pool's delegates and runs the recovery protocol (module docstring) through its
    :class:`Recovery` (``self.recovery``: its public steps, never the pool's internals).

    It also starts the respawned delegates: PR_SET_PDEATHSIG follows the thread that forked, so this
    thread lives until the pool has stopped every delegate (``released``)."""

    def __init__(self, recovery: "Recovery", host: str, port: int):
        super().__init__(daemon=True, name=f"titan_ext-delegate-supervisor-{recovery.pool_id}")
        self.recovery = recovery
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=recovery.timeout_s))
        self.root = f"titanx/{recovery.pool_id}/"
        self._inbox_seen = 0
        self._agreeing: dict[Link, tuple[float, float]] = {}   # send links awaiting ``first``: (t0, deadline)
        self._causes: dict[Link, str] = {}   # why a link went down, when not a plain death
        self.error: str | None = None
        self.announced = threading.Event()   # the peers were told this pool is closing
        self.released = threading.Event()    # the pool stopped its delegates: this thread may end

    # --- keys ---------------------------------------------------------------------------------
    def _key(self, lane: Lane, what: str) -> str:
        return f"{self.recovery.lane_prefix(lane.channel, lane.index, lane.epoch)}{what}"

    def _inbox(self, rank: int) -> str:
        return f"{self.root}inbox/{rank}"

    def _closed_key(self, rank: int) -> str:
        return f"{self.root}closed/{rank}"

    # --- loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while not self.recovery.closed:
                self._tick()
        except Exception as exc:  # noqa: BLE001 - the store is gone (job ending) or a bug: stop watching
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            try:
                self.store.set(self._closed_key(self.recovery.rank), "1")
            except Exception:  # noqa: BLE001 - the store may be gone already
                pass
            self.announced.set()
            self.released.wait()

    def _tick(self) -> None:
        links = [lk for lk in self.recovery.links() if lk.state == UP and lk.error is None]
        fds = [lk.lane.pidfd for lk in links if lk.lane.pidfd is not None]
        # while a sender waits for its peer's replay point, poll the store for it every few ms
        wait_s = AGREE_POLL_S if self._agreeing else TICK_S
        if fds:
            select.select(fds, [], [], wait_s)
        else:
            time.sleep(wait_s)
        if self.recovery.closed:
            return
        declared = self._declared_by_peers(links)
        down = []
        for lk in links:
            if lane_dead(lk.lane) or lk in declared:
                down.append(lk)
            elif lk.lane.frozen(self.recovery.heartbeat_timeout_s):  # SIGSTOP or hung: like a dead one
                self._causes[lk] = f"frozen: no heartbeat for {self.recovery.heartbeat_timeout_s:.0f} s"
                down.append(lk)
        for lk in down:  # every dead link is declared and reaped before any agreement is awaited
            self._start_recovery(lk)
        for lk in list(self._agreeing):
            self._try_agree(lk)

    def _declared_by_peers(self, links: list[Link]) -> list[Link]:
        seen = int(self.store.add(self._inbox(self.recovery.rank), 0))
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
            self._agreeing[link] = (t0, t0 + self.recovery.timeout_s)
            return
        first = self.recovery.recover_recv(link)
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
                              f"point within {self.recovery.timeout_s:.0f} s")
                link.state = DOWN
            return
        del self._agreeing[link]
        first = int(self.store.get(key))
        self._fell_back(link, t0, first, self.recovery.recover_send(link, first))

    def _fell_back(self, link: Link, t0: float, first: int, replayed: int) -> None:
        """The link is on the direct path: log it and start its new delegate (step 5)."""
        lane = link.lane
        self.recovery.log_event(link, "fallback", epoch=lane.epoch, first_undelivered=first,
                             replayed=replayed, recovery_ms=1e3 * (time.monotonic() - t0),
                             exit_code=lane.proc.returncode if lane.proc else None,
                             cause=self._causes.pop(link, "died"))
        try:
            self.recovery.respawn(link)
        except Exception as exc:  # noqa: BLE001 - the lane stays on the direct path (correct, slower)
            self.recovery.log_event(link, "respawn_failed", epoch=lane.epoch + 1, error=f"{type(exc).__name__}: {exc}")
