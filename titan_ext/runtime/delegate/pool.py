"""Delegate processes and the training-process side of the delegate data plane (PipeMorph §5.2).

A :class:`DelegatePool` belongs to one training rank.  For every *channel* it takes part in (a
``(src, dst, direction)`` triple, direction ``"F"`` for activations and ``"B"`` for gradients) it runs
``lanes[direction]`` delegate processes, each with its own shared-memory slot ring ("each with its own
queue"): send-F / send-B delegates on the sending rank, recv-F / recv-B delegates on the receiving rank.
Lane ``k`` of a channel is one 2-process Gloo group (send delegate = rank 0, recv delegate = rank 1)
rendezvoused through the job's TCPStore.

Messages carry a per-channel sequence number chosen by the caller (both ends count the same way, the
way direct P2P matches the n-th send with the n-th receive); message ``seq`` travels on lane
``seq % lanes``.  Receivers fetch eagerly; the training process matches by sequence number, so a
duplicate (a failover retry of a message that also got through the primary path) is dropped and an
early arrival is kept aside until its receive is posted.

Killed delegate: with :meth:`DelegatePool.enable_fallback` (what :class:`P2PRouter` does by default)
the lane's traffic falls back to the direct path, exactly (no message lost or repeated), a new delegate
is started in the background and the lane returns to it (the protocol: :mod:`.recovery`).  Without it,
a dead delegate is a **clean stop**: every operation of the pool raises :class:`DelegateError` naming
the lane, the pid and the exit status, and the peer's delegate sees its Gloo connection close and fails
the same way.
"""

from __future__ import annotations

import atexit
import itertools
import math
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from . import ring as R
from ._device import D2H_STREAM, H2D_STREAM, layer_for, refuse_capture
from ._ext import cuda_available, load_ext
from .recovery import DELEGATE, DIRECT, DOWN, UP, Link, LinkDown, Supervisor, kill_lane, lane_dead, tag

__all__ = ["Channel", "DelegateError", "DelegatePool", "delegates_needed", "pipeline_channels", "store_address"]


class DelegateError(RuntimeError):
    """A delegate process died or failed, or a delegate-path message did not arrive in time."""


@dataclass(frozen=True)
class Channel:
    src: int
    dst: int
    direction: str  # "F" (activations, stage s -> s+1) or "B" (gradients, stage s+1 -> s)

    def kind(self, rank: int) -> str:
        return f"{'send' if self.src == rank else 'recv'}-{self.direction}"


def pipeline_channels(rank: int, stage_to_rank: Sequence[int]) -> list[Channel]:
    """The channels ``rank`` takes part in for a pipeline whose stage ``s`` runs on ``stage_to_rank[s]``."""
    out: list[Channel] = []
    for s in range(len(stage_to_rank) - 1):
        a, b = stage_to_rank[s], stage_to_rank[s + 1]
        if a == b:
            continue
        for ch in (Channel(a, b, "F"), Channel(b, a, "B")):
            if rank in (ch.src, ch.dst) and ch not in out:
                out.append(ch)
    return out


def delegates_needed(production_bytes_per_s: float, delegate_bytes_per_s: float, max_delegates: int = 8) -> int:
    """Number of delegates of one kind so that consumption keeps pace with production (§5.2: 8 messages/s
    produced, 2/s per delegate → 4 queues).  At least 1, at most ``max_delegates``."""
    if max_delegates < 1:
        raise ValueError("max_delegates must be >= 1")
    if not (production_bytes_per_s > 0) or math.isnan(production_bytes_per_s):
        return 1
    if not (delegate_bytes_per_s > 0) or math.isinf(production_bytes_per_s):
        return max_delegates
    return max(1, min(max_delegates, math.ceil(production_bytes_per_s / delegate_bytes_per_s - 1e-9)))


def store_address() -> tuple[str, int]:
    """(host, port) of the job's TCPStore: the default process group's store, else MASTER_ADDR/PORT."""
    if dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
        for _ in range(8):
            if isinstance(store, dist.TCPStore):
                return store.host, store.port
            store = getattr(store, "underlying_store", None)
            if store is None:
                break
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host and port:
        return host, int(port)
    raise RuntimeError("delegates need the job's TCPStore: init the default process group with a TCP store "
                       "or set MASTER_ADDR/MASTER_PORT (or pass store_host/store_port)")


_pool_ids = itertools.count()
_live_pools: "weakref.WeakSet[DelegatePool]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for pool in list(_live_pools):
        pool.close()


class _Lane:
    """One delegate process and its ring (a link's delegate of one epoch)."""

    def __init__(self, channel: Channel, index: int, role: str, ring: R.SlotRing, epoch: int = 0):
        self.channel, self.index, self.role, self.ring, self.epoch = channel, index, role, ring, epoch
        self.proc: subprocess.Popen | None = None
        self.pidfd: int | None = None
        self.cursor = 0
        self.keep: list = [None] * ring.num_slots   # tensors an async copy still reads / writes
        self.tokens: list[int] = [0] * ring.num_slots
        self.dev_flags: torch.Tensor | None = None
        self._beat = (-1, 0.0)   # (last CTRL_HEARTBEAT seen, when it changed)

    def frozen(self, timeout_s: float) -> bool:
        """The delegate's heartbeat (worker.py) has not moved for ``timeout_s``: stopped (SIGSTOP) or
        hung — treated like a dead delegate (issue 26).  Watched once it runs (its start, which imports
        torch, has its own timeout)."""
        beat, now = self.ring.region.load64(R.CTRL_HEARTBEAT), time.monotonic()
        if beat != self._beat[0] or self.ring.region.load(R.CTRL_DELEGATE_STATE) != 1:
            self._beat = (beat, now)
            return False
        return now - self._beat[1] > timeout_s

    def describe(self) -> str:
        c = self.channel
        pid = self.proc.pid if self.proc else None
        epoch = f", epoch {self.epoch}" if self.epoch else ""
        return f"{self.role}-{c.direction} delegate lane {self.index} of {c.src}->{c.dst} (pid {pid}{epoch})"


class _Recv:
    """A posted delegate-path receive; ``wait()`` copies the message into ``tensor``."""

    def __init__(self, pool: "DelegatePool", key, seq: int, tensor: torch.Tensor):
        self.pool, self.key, self.seq, self.tensor = pool, key, seq, tensor
        self.done = False
        self.stream = None

    def wait(self, timeout: float | None = None) -> bool:
        if not self.done:
            self.pool._complete(self, self.pool.timeout_s if timeout is None else timeout)
        return True

    def is_completed(self) -> bool:
        if not self.done:
            self.pool._drain(self.key)
        return self.done


class _Done:
    """Handle of a send that is already in its slot (CPU copy) or enqueued behind a signal (CUDA)."""

    def wait(self, timeout=None) -> bool:  # noqa: ARG002
        return True

    def is_completed(self) -> bool:
        return True


class _DirectSend:
    """A fallback send on the direct path: route marker + payload (both kept alive until waited)."""

    def __init__(self, works: list, keep: list):
        self.works, self.keep = works, keep

    def wait(self, timeout=None) -> bool:  # noqa: ARG002
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class DelegatePool:
    """Delegate processes of one training rank, and its send/receive API.

    Args:
        rank: this training rank (global rank, as used by the P2P ops).
        channels: channels this rank takes part in (see :func:`pipeline_channels`).
        lanes: delegates per kind: an int for all, or ``{"F": n, "B": m}`` (both ends must agree).
        num_slots / slot_bytes: ring geometry per lane; a message must fit in one slot.  Host memory
            per lane is about ``num_slots * slot_bytes`` — activations queue here, not on the device.
        store_host / store_port: the job's TCPStore (default: :func:`store_address`).
        timeout_s: how long an operation may wait before :class:`DelegateError`.
        heartbeat_timeout_s: a delegate whose heartbeat stops for this long (SIGSTOP, a hang) is treated
            as dead: with fallback, killed and recovered like a killed one; without, a clean stop.
        device: the stage's device layer (``titan_ext.runtime.device``; the executor's) or device: every
            CUDA call of the pool (device flags, copy streams, kernels) runs under its context, from any
            thread (``cuda`` without an index: the current device, read here).
        pool_id: rendezvous namespace; defaults to a per-process counter (create pools in the same
            order on every rank).
    """

    def __init__(self, rank: int, channels: Iterable[Channel], lanes: int | Mapping[str, int] = 1,
                 num_slots: int = 8, slot_bytes: int = 16 << 20, store_host: str | None = None,
                 store_port: int | None = None, timeout_s: float = 120.0, pool_id: str | None = None,
                 start_timeout_s: float = 180.0, device=None, heartbeat_timeout_s: float = 10.0):
        load_ext()
        R.sweep_stale_segments()
        self.rank = rank
        self.channels = list(channels)
        self.lanes_per = {"F": lanes, "B": lanes} if isinstance(lanes, int) else dict(lanes)
        self.timeout_s = timeout_s
        if not heartbeat_timeout_s > 10 * R.HEARTBEAT_S:
            raise ValueError(f"heartbeat_timeout_s must be > {10 * R.HEARTBEAT_S} s, got {heartbeat_timeout_s}")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.num_slots, self.slot_bytes = num_slots, slot_bytes
        if store_host is None or store_port is None:
            store_host, store_port = store_address()
        self.pool_id = pool_id if pool_id is not None else f"p{next(_pool_ids)}"
        self.layer = layer_for(device if device is not None else ("cuda" if cuda_available() else None))
        self.cuda = self.layer is not None and cuda_available()
        self.device = self.layer.device if self.cuda else None
        self._closed = False
        self._store_host, self._store_port = store_host, store_port
        self.lanes: dict[tuple[int, str], list[Link]] = {}      # (peer, direction) -> send links
        self.rlanes: dict[tuple[int, str], list[Link]] = {}     # (peer, direction) -> recv links
        self.fallback = False          # enable_fallback(): a dead delegate → direct path, respawn, return
        self._group = None             # direct group of the fallback path
        self._supervisor: Supervisor | None = None
        self._orphans: list[_DirectSend] = []   # replays and switch markers nobody waits on
        self.fallback_events: list[dict] = []
        self._pending: dict[tuple[int, str], dict[int, _Recv]] = {}
        self._early: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
        self._consumed: dict[tuple[int, str], set[int]] = {}
        self._floor: dict[tuple[int, str], int] = {}
        # one copy stream per direction: a D2H send never queues behind an H2D receive (or the reverse)
        self._d2h_stream = self._h2d_stream = None
        if self.cuda:
            self._d2h_stream, self._h2d_stream = self.layer.stream(D2H_STREAM), self.layer.stream(H2D_STREAM)
        # receives are waited on by other threads (PipeMorph's per-peer arrival watchers): the recv-side
        # tables are guarded by this lock, which is never held while blocking.
        self._lock = threading.RLock()
        _live_pools.add(self)
        self._spawned: list[_Lane] = []   # every delegate this pool started (respawns included)
        try:
            for ch in self.channels:
                if rank not in (ch.src, ch.dst) or ch.src == ch.dst:
                    raise ValueError(f"rank {rank} is not an end of {ch}")
                role = "send" if ch.src == rank else "recv"
                n = int(self.lanes_per.get(ch.direction, 1))
                if n < 1:
                    raise ValueError("lanes must be >= 1")
                key = (ch.dst if role == "send" else ch.src, ch.direction)
                table = self.lanes if role == "send" else self.rlanes
                table[key] = []
                for k in range(n):
                    lane = self._new_lane(ch, k, role, 0)
                    table[key].append(Link(ch, k, role, n, lane))
                    self._launch(lane)
                if role == "recv":
                    self._pending[key], self._early[key], self._consumed[key] = {}, {}, set()
            self._wait_started(start_timeout_s)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------
    def links(self) -> list[Link]:
        return [lk for table in (self.lanes, self.rlanes) for links in table.values() for lk in links]

    def lane_prefix(self, c: Channel, index: int, epoch: int) -> str:
        """Store namespace of one delegate pair (both ends build the same one)."""
        return f"titanx/{self.pool_id}/{c.src}-{c.dst}/{c.direction}/{index}/" + (f"e{epoch}/" if epoch else "")

    def _new_lane(self, ch: Channel, index: int, role: str, epoch: int) -> _Lane:
        """A lane and its ring; with CUDA its device flags on the pool's device (also when the supervisor
        thread respawns it: that thread's current device is not the stage's)."""
        lane = _Lane(ch, index, role, R.SlotRing.create(self.num_slots, self.slot_bytes), epoch)
        if self.cuda:
            with self.layer.context():
                lane.ring.region.cuda_register()
                lane.dev_flags = torch.zeros(self.num_slots, dtype=torch.int32, device=self.device)
        return lane

    def _launch(self, lane: _Lane) -> None:
        self._spawned.append(lane)
        lane.proc = self._spawn(lane)
        lane.pidfd = os.pidfd_open(lane.proc.pid)

    def _spawn(self, lane: _Lane) -> subprocess.Popen:
        fd = lane.ring.region.fd
        cmd = [sys.executable, "-m", "titan_ext.runtime.delegate.worker", "--fd", str(fd),
               "--slots", str(lane.ring.num_slots), "--slot-bytes", str(lane.ring.slot_bytes),
               "--role", lane.role, "--store-host", self._store_host, "--store-port", str(self._store_port),
               "--prefix", self.lane_prefix(lane.channel, lane.index, lane.epoch),
               "--parent", str(os.getpid()), "--timeout-s", str(max(self.timeout_s, 60.0))]
        if self.cuda:
            cmd.append("--gpu-flags")
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["CUDA_VISIBLE_DEVICES"] = ""  # delegates never touch the GPU
        return subprocess.Popen(cmd, pass_fds=(fd,), env=env, close_fds=True)

    def _wait_started(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for lane in self._spawned:
            while lane.ring.region.load(R.CTRL_DELEGATE_STATE) != 1:
                self._check_lane(lane)
                if time.monotonic() > deadline:
                    raise DelegateError(f"{lane.describe()} did not start within {timeout_s:.0f} s")
                time.sleep(0.01)

    def _check_lane(self, lane: _Lane) -> None:
        err = lane.ring.error_text()
        if err:
            raise DelegateError(f"{lane.describe()} failed: {err}")
        if lane.proc is not None and lane.proc.poll() is not None:
            rc = lane.proc.returncode
            how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
            raise DelegateError(f"{lane.describe()} {how}; fallback is off (enable_fallback) — stopping")
        if lane.frozen(self.heartbeat_timeout_s):
            raise DelegateError(f"{lane.describe()} is frozen (no heartbeat for {self.heartbeat_timeout_s:.0f} s);"
                                f" fallback is off (enable_fallback) — stopping")

    def check_health(self) -> None:
        """Raise :class:`DelegateError` if a link is unusable: with fallback, only when its peer did not
        take part in the recovery; without, when any delegate died or failed."""
        if self._closed:
            raise DelegateError("delegate pool is closed")
        for link in self.links():
            if link.error:
                raise DelegateError(link.error)
            if not self.fallback:
                self._check_lane(link.lane)

    def _lane_ok(self, link: Link, lane: _Lane) -> None:
        """Raise LinkDown (fallback: the supervisor takes over) or DelegateError (no fallback)."""
        if not self.fallback:
            self._check_lane(lane)
            return
        if link.error:
            raise DelegateError(link.error)
        if link.state != UP or link.lane is not lane:
            raise LinkDown
        if lane.ring.region.load(R.CTRL_ERROR) or lane_dead(lane):
            sup = self._supervisor
            if not sup.is_alive() or sup.announced.is_set():
                raise DelegateError(f"{lane.describe()} died and the delegate supervisor has stopped "
                                    f"({sup.error or 'pool closing'})")
            time.sleep(0.01)  # dead: the supervisor notices within a tick and changes the state
            raise LinkDown

    def _wait(self, link: Link, lane: _Lane, i: int, want: int, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        sleep_us = 50 if self.cuda else 1000
        while True:
            rc = lane.ring.wait_state(i, want, 0.2, R.CTRL_ERROR, sleep_us)
            if rc == 0:
                return
            self._lane_ok(link, lane)
            if self._closed:
                raise DelegateError("delegate pool closed while waiting")
            if time.monotonic() > deadline:
                raise DelegateError(f"timed out after {timeout_s:.1f} s waiting for {what} on {lane.describe()}")

    # ------------------------------------------------------------------------------------------
    # send
    # ------------------------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, direction: str, seq: int):
        """Queue message ``seq`` of channel (this rank → ``dst``, ``direction``).  Returns once the bytes
        are in a slot (CPU) or the D2H copy + signal are enqueued (CUDA); never waits for the link.

        With fallback on, the pool keeps a reference to ``tensor`` until the peer acknowledges the
        message (do not modify it in place before), and while the link's delegate is being replaced
        the message goes over the direct path (the returned handle then waits like a direct send)."""
        links = self.lanes.get((dst, direction))
        if links is None:
            raise KeyError(f"no send-{direction} delegates to rank {dst} in this pool")
        if self.cuda:
            refuse_capture("DelegatePool.send")
        link = links[seq % len(links)]
        if not self.fallback:
            return self._ring_send(link, link.lane, tensor, seq)
        while True:
            with link.mutex:
                if link.error:
                    raise DelegateError(link.error)
                if link.state == DOWN and self._spare_ready(link):
                    self._switch_send(link, seq)
                if link.state == UP:
                    try:
                        handle = self._ring_send(link, link.lane, tensor, seq)
                    except LinkDown:
                        continue
                    link.keep(seq, tensor, link.lane.ring.region.load64(R.CTRL_ACKED))
                    return handle
                if link.state == DOWN:  # callers may drop send handles: the pool keeps it until done
                    return self._orphan(self._direct_send(link, tensor, seq, DIRECT))
            time.sleep(0.005)  # RECOVERING: the supervisor is agreeing on the replay point

    def _ring_send(self, link: Link, lane: _Lane, tensor: torch.Tensor, seq: int):
        ring, i = lane.ring, lane.cursor
        if ring.state(i) != R.FREE:  # ring full: back-pressure (add lanes/slots if this shows up)
            self._wait(link, lane, i, R.FREE, self.timeout_s, f"a free send slot (seq {seq})")
        self._lane_ok(link, lane)
        ring.set_state(i, R.WRITING, wake=False)
        nbytes = ring.write_header(i, seq, tensor)
        if tensor.is_cuda:
            src = tensor.contiguous()
            with self.layer.context():
                self._d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._d2h_stream):
                    src.record_stream(self._d2h_stream)
                    ring.region.d2h_signal(src, ring.geometry.slot_offset(i) + R.SLOT_PAYLOAD,
                                           ring.state_offset(i), R.READY)
            lane.keep[i] = src
        else:
            if nbytes:
                ring.copy_in(i, tensor, nbytes)
            ring.set_state(i, R.READY)
        lane.cursor = (i + 1) % ring.num_slots
        return _Done()

    def set_link_delay_ms(self, dst: int, direction: str, ms: float) -> None:
        """Inject a one-way delay on this rank's outgoing delegate link (tests and benchmarks)."""
        for link in self.lanes[(dst, direction)]:
            link.lane.ring.region.store64(R.CTRL_DELAY_US, int(round(ms * 1000)))

    # ------------------------------------------------------------------------------------------
    # fallback (protocol: recovery.py, docs/delegate.md "Killed delegate")
    # ------------------------------------------------------------------------------------------
    def enable_fallback(self, group=None) -> None:
        """A dead delegate no longer stops training: its lane falls back to direct P2P on ``group``
        (None: the default group; peers are global ranks) with no message lost or repeated, a new
        delegate is started in the background and the lane returns to it.  Call it on both ends of
        every channel (P2PRouter does), before the first message."""
        if self.fallback:
            return
        self._group, self.fallback = group, True
        self._supervisor = Supervisor(self, self._store_host, self._store_port)
        self._supervisor.start()

    def _spare_ready(self, link: Link) -> bool:
        spare = link.spare
        return spare is not None and spare.ring.region.load(R.CTRL_DELEGATE_STATE) == 1 and not lane_dead(spare)

    def _direct_send(self, link: Link, tensor: torch.Tensor, seq: int, route: int) -> _DirectSend:
        marker = torch.tensor([route], dtype=torch.int64)
        d = link.channel.direction
        works, keep = [dist.isend(marker, link.peer, group=self._group, tag=tag(d, seq, False))], [marker]
        if route == DIRECT:
            data = tensor if tensor.is_contiguous() else tensor.contiguous()
            works.append(dist.isend(data, link.peer, group=self._group, tag=tag(d, seq, True)))
            keep.append(data)
        return _DirectSend(works, keep)

    def _orphan(self, handle: _DirectSend) -> _DirectSend:
        """Keep a direct send alive until it completes (its caller need not wait on it)."""
        with self._lock:
            self._orphans = [h for h in self._orphans if not h.is_completed()] + [handle]
        return handle

    def _switch_send(self, link: Link, seq: int) -> None:
        """Sender, link DOWN, new delegate connected: message ``seq`` and later go through it (caller holds
        link.mutex)."""
        self._orphan(self._direct_send(link, None, seq, DELEGATE))
        link.lane, link.spare, link.state = link.spare, None, UP
        self._log_event(link, "returned", epoch=link.lane.epoch, from_seq=seq)

    def _recover_send(self, link: Link, first: int) -> int:
        """Sender side of a recovery: replay the kept messages the receiver's ring did not deliver."""
        with link.mutex:  # a send in progress finishes (ring write + keep) or aborts first
            replay = [(s, t) for s, t in link.retained if s >= first]
            link.retained.clear()
            link.state = DOWN
            for s, t in replay:
                self._orphan(self._direct_send(link, t, s, DIRECT))
        return len(replay)

    def _recover_recv(self, link: Link) -> int:
        """Receiver side: take the complete messages left in the dead ring; open the direct window."""
        key = (link.peer, link.channel.direction)
        with self._lock:
            lane = link.lane
            while lane.ring.state(lane.cursor) == R.READY:
                self._take(key, link, lane, lane.cursor)
            first = link.next_ring_seq
            link.windows.append([first, None])
            link.route_next = first
            link.state = DOWN
        return first

    def _respawn(self, link: Link) -> None:
        old = link.lane
        spare = self._new_lane(old.channel, old.index, old.role, old.epoch + 1)
        with self._lock:  # in place before its process exists: the peer can only switch once it runs
            link.spare = spare
        self._launch(spare)
        self._log_event(link, "respawned", epoch=spare.epoch, pid=spare.proc.pid)

    def _log_event(self, link: Link, event: str, **info) -> None:
        c = link.channel
        with self._lock:
            self.fallback_events.append({"event": event, "kind": f"{link.role}-{c.direction}", "src": c.src,
                                         "dst": c.dst, "lane": link.index, "time": time.time(), **info})

    # ------------------------------------------------------------------------------------------
    # receive
    # ------------------------------------------------------------------------------------------
    def post_recv(self, tensor: torch.Tensor, src: int, direction: str, seq: int) -> _Recv:
        """Post the receive of message ``seq`` of channel (``src`` → this rank, ``direction``) into
        ``tensor``; its ``wait()`` returns once the data is there (CPU) or ordered before the current
        stream's next kernel (CUDA)."""
        key = (src, direction)
        if key not in self.rlanes:
            raise KeyError(f"no recv-{direction} delegates from rank {src} in this pool")
        h = _Recv(self, key, seq, tensor)
        if tensor.is_cuda:
            refuse_capture("DelegatePool.post_recv")
            h.stream = torch.cuda.current_stream(self.device)  # the consumer's stream waits on the signal
        with self._lock:
            early = self._early[key].pop(seq, None)
            if early is not None:
                self._copy_out(h, early)
            elif self._is_consumed(key, seq):
                raise DelegateError(f"message {seq} from rank {src} ({direction}) was already received")
            else:
                self._pending[key][seq] = h
        return h

    def poll(self, src: int, direction: str, seq: int) -> bool:
        """Has message ``seq`` (posted) arrived on the delegate path?  Never blocks."""
        key = (src, direction)
        with self._lock:
            self._drain(key)
            h = self._pending[key].get(seq)
            if h is None:
                return self._is_consumed(key, seq) or seq in self._early[key]
            return h.done

    def cancel(self, src: int, direction: str, seq: int) -> None:
        """Forget a posted receive that was satisfied elsewhere (primary path); a later delegate copy
        of it is dropped as a duplicate."""
        key = (src, direction)
        with self._lock:
            self._pending[key].pop(seq, None)
            self._early[key].pop(seq, None)
            self._mark_consumed(key, seq)

    def _mark_consumed(self, key, seq: int) -> None:
        consumed = self._consumed[key]
        consumed.add(seq)
        if len(consumed) > 4096:  # keep a window: retries are never that far behind
            floor = max(consumed) - 2048
            self._consumed[key] = {s for s in consumed if s >= floor}
            self._floor[key] = max(self._floor.get(key, -1), floor)

    def _is_consumed(self, key, seq: int) -> bool:
        return seq in self._consumed[key] or seq < self._floor.get(key, -1)

    def _complete(self, h: _Recv, timeout_s: float) -> None:
        links = self.rlanes[h.key]
        link = links[h.seq % len(links)]
        deadline = time.monotonic() + timeout_s
        what = f"message {h.seq} from rank {h.key[0]} ({h.key[1]})"
        while True:
            with self._lock:
                self._drain(h.key)
                if h.done:
                    return
                if link.error:
                    raise DelegateError(link.error)
                state, lane, direct = link.state, link.lane, link.in_window(h.seq)
                i = lane.cursor
            if direct:
                if self._recv_direct(link, h):
                    return
                continue  # the window closed before h.seq: it comes from the new delegate
            if time.monotonic() > deadline:
                raise DelegateError(f"timed out after {timeout_s:.1f} s waiting for {what} on {lane.describe()}")
            if state != UP:
                time.sleep(0.005)  # RECOVERING: the supervisor is taking what the dead ring holds
                continue
            try:  # block without the lock until the lane's next slot is READY
                self._wait(link, lane, i, R.READY, max(deadline - time.monotonic(), 0.0), what)
            except LinkDown:
                continue

    def _recv_direct(self, link: Link, h: _Recv) -> bool:
        """Receive ``h`` in the link's direct window; False if the sender switched back at or below it."""
        if self._route(link, h.seq) is None:
            return False
        with self._lock:
            self._pending[h.key].pop(h.seq, None)
        t = h.tensor if h.tensor.is_contiguous() else torch.empty_like(h.tensor)
        with torch.no_grad():
            dist.irecv(t, link.peer, group=self._group, tag=tag(link.channel.direction, h.seq, True)).wait()
            if t is not h.tensor:
                h.tensor.copy_(t)
        with self._lock:
            link.routes.pop(h.seq, None)
            h.done = True
            self._mark_consumed(h.key, h.seq)
        return True

    def _route(self, link: Link, seq: int) -> int | None:
        """DIRECT if message ``seq`` travels on the direct path, None if the sender switched back to a new
        delegate at or below ``seq``.  Route markers are read in sequence order, so the switch point is
        found whatever order the receives are waited in."""
        with link.mutex:
            while True:
                with self._lock:
                    if seq in link.routes:
                        return DIRECT
                    if not link.in_window(seq):
                        return None
                    s = link.route_next
                marker = torch.empty(1, dtype=torch.int64)
                dist.irecv(marker, link.peer, group=self._group, tag=tag(link.channel.direction, s, False)).wait()
                with self._lock:
                    if int(marker[0]) == DIRECT:
                        link.routes[s] = DIRECT
                        link.route_next = s + link.stride
                    else:
                        self._switch_recv(link, s)

    def _switch_recv(self, link: Link, seq: int) -> None:
        """Receiver: the sender's route marker says ``seq`` and later come from the new delegate."""
        if link.spare is None:
            raise DelegateError(f"rank {link.peer} switched lane {link.index} back at {seq} but no new "
                                f"delegate was started here")
        link.windows[-1][1] = seq
        link.lane, link.spare, link.state = link.spare, None, UP
        link.next_ring_seq, link.route_next = seq, None
        self._log_event(link, "returned", epoch=link.lane.epoch, from_seq=seq)

    def _drain(self, key, block_lane=None) -> None:  # noqa: ARG002
        """Take every READY message at the head of the channel's live lanes (caller holds the lock)."""
        with self._lock:
            for link in self.rlanes[key]:
                if link.state != UP:
                    continue  # the supervisor takes what a dead ring holds (_recover_recv)
                lane = link.lane
                while lane.ring.state(lane.cursor) == R.READY:
                    self._take(key, link, lane, lane.cursor)

    def _take(self, key, link: Link, lane: _Lane, i: int) -> None:
        ring = lane.ring
        seq, nbytes, dtype, shape = ring.read_header(i)
        h = self._pending[key].pop(seq, None)
        ring.set_state(i, R.BUSY, wake=False)
        lane.cursor = (i + 1) % ring.num_slots
        link.next_ring_seq = max(link.next_ring_seq, seq + link.stride)
        if h is not None:
            t = h.tensor
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                ring.set_state(i, R.FREE)
                raise DelegateError(f"message {seq} from rank {key[0]}: got {dtype}{list(shape)}, "
                                    f"receive posted for {t.dtype}{list(t.shape)}")
            with torch.no_grad():  # receive buffers of pipeline stages are leaves that require grad
                if t.is_cuda:
                    self._h2d(lane, i, t, h.stream)
                else:
                    if nbytes:
                        ring.copy_out(i, t, nbytes)
                    ring.set_state(i, R.FREE)
            h.done = True
            self._mark_consumed(key, seq)
        elif self._is_consumed(key, seq):  # duplicate (failover retry of a message that made it): drop
            ring.set_state(i, R.FREE)
        else:  # arrived before its receive was posted: keep it aside, free the slot
            self._early[key][seq] = ring.typed_view(i, dtype, shape).clone()
            ring.set_state(i, R.FREE)

    def _copy_out(self, h: _Recv, data: torch.Tensor) -> None:
        if h.tensor.dtype != data.dtype or tuple(h.tensor.shape) != tuple(data.shape):
            raise DelegateError(f"message {h.seq}: got {data.dtype}{list(data.shape)}, "
                                f"receive posted for {h.tensor.dtype}{list(h.tensor.shape)}")
        with torch.no_grad():  # receive buffers of pipeline stages are leaves that require grad
            h.tensor.copy_(data)
        h.done = True
        self._mark_consumed(h.key, h.seq)

    def _h2d(self, lane: _Lane, i: int, dst: torch.Tensor, consumer) -> None:
        ring = lane.ring
        ext = load_ext()
        target = dst if dst.is_contiguous() else torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
        lane.tokens[i] = (lane.tokens[i] + 1) & 0x7FFFFFFF
        flag = lane.dev_flags[i:i + 1]
        with self.layer.context():  # may run on an arrival-watcher thread
            self._h2d_stream.wait_stream(consumer)
            with torch.cuda.stream(self._h2d_stream):
                target.record_stream(self._h2d_stream)
                ring.region.h2d_signal(ring.geometry.slot_offset(i) + R.SLOT_PAYLOAD, target,
                                       ring.state_offset(i), R.FREE, flag, lane.tokens[i])
            with torch.cuda.stream(consumer):
                ext.stream_wait_flag(flag, lane.tokens[i])  # the consumer stream waits on the device signal
                if target is not dst:
                    dst.copy_(target)

    # ------------------------------------------------------------------------------------------
    def stats(self) -> list[dict]:
        """Per link: its delegate in use (or the dead one while on the direct path), ring counters,
        ``state`` ("up" / "recovering" / "down") and ``epoch`` (number of respawns)."""
        out = []
        for link in self.links():
            lane, c = link.lane, link.channel
            out.append({"kind": f"{lane.role}-{c.direction}", "src": c.src, "dst": c.dst, "lane": lane.index,
                        "pid": lane.proc.pid if lane.proc else None, "state": link.state, "epoch": lane.epoch,
                        **lane.ring.stats()})
        return out

    def pids(self) -> list[int]:
        """Every delegate process this pool started (respawned ones included)."""
        return [lane.proc.pid for lane in getattr(self, "_spawned", []) if lane.proc is not None]

    def close(self, grace_s: float = 5.0) -> None:
        """Stop the delegates: send delegates first drain what is queued (up to ``grace_s``), then all
        are terminated.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        supervisor = self._supervisor
        if supervisor is not None:  # it tells the peers this pool is closing: no recovery then
            supervisor.announced.wait(timeout=2.0)
        lanes = getattr(self, "_spawned", [])
        for lane in lanes:
            lane.ring.region.store(R.CTRL_STOP, 1)
            for i in range(lane.ring.num_slots):  # wake delegates sleeping on a slot flag
                lane.ring.region.store(lane.ring.state_offset(i), lane.ring.state(i))
        deadline = time.monotonic() + grace_s
        for lane in lanes:
            if lane.proc is None or lane.role != "send":
                continue
            try:
                lane.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for lane in lanes:
            if lane.proc is not None and lane.proc.poll() is None:
                lane.proc.send_signal(signal.SIGTERM)
        for lane in lanes:
            if lane.proc is None:
                continue
            try:
                lane.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                lane.proc.kill()
                lane.proc.wait()
        for lane in lanes:
            kill_lane(lane)  # closes the pidfds
        if supervisor is not None:  # respawned delegates are its children (PR_SET_PDEATHSIG): end it last
            supervisor.released.set()
            supervisor.join(timeout=2.0)
        self._orphans.clear()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        _live_pools.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
