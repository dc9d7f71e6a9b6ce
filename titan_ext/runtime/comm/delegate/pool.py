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
import numbers
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from titan_ext.args import ArgumentTypeError, choice_arg, counts_arg, int_arg, real_arg

from . import ring as R
from ._device import layer_for
from ._ext import cuda_available, load_ext
from .lanes import LaneProcesses
from .link import DelegateError, Link
from .recovery import Recovery
from .recvpath import Recv, RecvMatcher
from .sendpath import SendPath

__all__ = ["Channel", "DelegateError", "DelegatePool", "delegates_needed", "pipeline_channels", "pool_shm_bytes",
           "store_address"]


@dataclass(frozen=True)
class Channel:
    src: int
    dst: int
    direction: str  # "F" (activations, stage s -> s+1) or "B" (gradients, stage s+1 -> s)

    def __post_init__(self) -> None:
        int_arg(self.src, "src", 0)
        int_arg(self.dst, "dst", 0)
        choice_arg(self.direction, "direction", ("F", "B"))
        if self.src == self.dst:
            raise ValueError(f"a channel joins two ranks, got src = dst = {self.src}")

    def kind(self, rank: int) -> str:
        return f"{'send' if self.src == rank else 'recv'}-{self.direction}"


def pipeline_channels(rank: int, stage_to_rank: Sequence[int]) -> list[Channel]:
    """The channels ``rank`` takes part in for a pipeline whose stage ``s`` runs on ``stage_to_rank[s]``."""
    int_arg(rank, "rank", 0)
    stage_to_rank = counts_arg(stage_to_rank, "stage_to_rank", minimum=0)
    if rank not in stage_to_rank:
        raise ValueError(f"rank {rank} runs no stage of stage_to_rank {stage_to_rank}")
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
    produced, 2/s per delegate → 4 queues).  At least 1, at most ``max_delegates``.  A rate that is NaN
    (not measured yet) counts as none produced / no throughput measured."""
    int_arg(max_delegates, "max_delegates", 1)
    for name, rate in (("production_bytes_per_s", production_bytes_per_s), ("delegate_bytes_per_s", delegate_bytes_per_s)):
        if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
            raise ArgumentTypeError(f"{name} must be a number, got {rate!r}")
        if rate < 0:
            raise ValueError(f"{name} must be >= 0, got {rate!r}")
    if not (production_bytes_per_s > 0) or math.isnan(production_bytes_per_s):
        return 1
    if not (delegate_bytes_per_s > 0) or math.isinf(production_bytes_per_s):
        return max_delegates
    return max(1, min(max_delegates, math.ceil(production_bytes_per_s / delegate_bytes_per_s - 1e-9)))


def pool_shm_bytes(channels: Iterable[Channel], lanes: int | Mapping[str, int], num_slots: int, slot_bytes: int) -> int:
    """Shared memory the rings of a pool take (one ring per lane of every channel)."""
    per = {"F": lanes, "B": lanes} if isinstance(lanes, int) else dict(lanes)
    n = sum(max(1, int(per.get(ch.direction, 1))) for ch in channels)
    return n * R.RingGeometry(num_slots, slot_bytes).total_bytes


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
        device: the stage's device layer (``titan_ext.runtime.execute.device``; the executor's) or device: every
            CUDA call of the pool (device flags, copy streams, kernels) runs under its context, from any
            thread (``cuda`` without an index: the current device, read here).
        pool_id: rendezvous namespace; defaults to a per-process counter (create pools in the same
            order on every rank).
    """

    def __init__(self, rank: int, channels: Iterable[Channel], lanes: int | Mapping[str, int] = 1,
                 num_slots: int = 8, slot_bytes: int = 16 << 20, store_host: str | None = None,
                 store_port: int | None = None, timeout_s: float = 120.0, pool_id: str | None = None,
                 start_timeout_s: float = 180.0, device=None, heartbeat_timeout_s: float = 10.0):
        # every argument checked before the extension loads, a segment is swept or a delegate starts
        int_arg(rank, "rank", 0)
        if isinstance(channels, (str, bytes)) or not hasattr(channels, "__iter__"):
            raise ArgumentTypeError(f"channels must be an iterable of Channel, got {type(channels).__name__}")
        channels = list(channels)
        for i, ch in enumerate(channels):
            if not isinstance(ch, Channel):
                raise ArgumentTypeError(f"channels[{i}] must be a Channel, got {ch!r}")
            if rank not in (ch.src, ch.dst):
                raise ValueError(f"rank {rank} is not an end of {ch}")
        if isinstance(lanes, Mapping):
            for kind, n in lanes.items():
                choice_arg(kind, "lanes key", ("F", "B"))
                int_arg(n, f"lanes[{kind!r}]", 1)
        else:
            int_arg(lanes, "lanes", 1)
        int_arg(num_slots, "num_slots", 1)
        int_arg(slot_bytes, "slot_bytes", 1)
        if store_host is not None and not isinstance(store_host, str):
            raise ArgumentTypeError(f"store_host must be a host name or None, got {store_host!r}")
        int_arg(store_port, "store_port", 1, optional=True)
        if pool_id is not None and not isinstance(pool_id, str):
            raise ArgumentTypeError(f"pool_id must be text or None, got {pool_id!r}")
        real_arg(timeout_s, "timeout_s", positive=True)
        real_arg(start_timeout_s, "start_timeout_s", positive=True)
        if not real_arg(heartbeat_timeout_s, "heartbeat_timeout_s") > 10 * R.HEARTBEAT_S:
            raise ValueError(f"heartbeat_timeout_s must be > {10 * R.HEARTBEAT_S} s, got {heartbeat_timeout_s}")
        load_ext()
        R.sweep_stale_segments()
        self.rank, self.channels, self.timeout_s = rank, list(channels), timeout_s
        self.lanes_per = {"F": lanes, "B": lanes} if isinstance(lanes, int) else dict(lanes)
        self.num_slots, self.slot_bytes = num_slots, slot_bytes
        # every ring reserved up front (posix_fallocate in SlotRing.create); a shortage is one error here
        R.check_shm(pool_shm_bytes(self.channels, self.lanes_per, num_slots, slot_bytes),
                    f"the delegate rings of rank {rank}")
        if store_host is None or store_port is None:
            store_host, store_port = store_address()
        self.pool_id = pool_id if pool_id is not None else f"p{next(_pool_ids)}"
        layer = layer_for(device if device is not None else ("cuda" if cuda_available() else None))
        self.layer = layer if layer is not None and cuda_available() else None
        self.cuda = self.layer is not None
        self._closed = False
        self.procs = LaneProcesses(self.pool_id, num_slots, slot_bytes, (store_host, store_port), timeout_s,
                                   heartbeat_timeout_s, self.layer)
        self.lanes: dict[tuple[int, str], list[Link]] = {}      # (peer, direction) -> send links
        self.rlanes: dict[tuple[int, str], list[Link]] = {}     # (peer, direction) -> recv links
        # receives are waited on by other threads (arrival watchers): the recv-side tables and the links'
        # recovery state are guarded by this lock, which is never held while blocking
        lock = threading.RLock()
        self.recovery = Recovery(rank, self.procs, self.links, lock)
        _live_pools.add(self)
        try:
            for ch in self.channels:
                self._add_channel(ch)
            self.sender = SendPath(self.lanes, self.recovery, self.layer, timeout_s)
            self.receiver = RecvMatcher(self.rlanes, self.recovery, lock, self.layer, timeout_s)
            self.recovery.receiver = self.receiver
            self.procs.wait_started(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _add_channel(self, ch: Channel) -> None:
        if self.rank not in (ch.src, ch.dst) or ch.src == ch.dst:
            raise ValueError(f"rank {self.rank} is not an end of {ch}")
        role = "send" if ch.src == self.rank else "recv"
        n = int(self.lanes_per.get(ch.direction, 1))
        if n < 1:
            raise ValueError("lanes must be >= 1")
        key = (ch.dst if role == "send" else ch.src, ch.direction)
        table = self.lanes if role == "send" else self.rlanes
        table[key] = []
        for k in range(n):
            lane = self.procs.new_lane(ch, k, role, 0)
            table[key].append(Link(ch, k, role, n, lane))
            self.procs.launch(lane)

    # ------------------------------------------------------------------------------------------
    def links(self) -> list[Link]:
        return [lk for table in (self.lanes, self.rlanes) for links in table.values() for lk in links]

    def lane_prefix(self, c: Channel, index: int, epoch: int) -> str:
        """Store namespace of one delegate pair (both ends build the same one)."""
        return self.procs.prefix(c, index, epoch)

    @property
    def device(self) -> torch.device | None:
        return self.layer.device if self.layer is not None else None

    @property
    def fallback(self) -> bool:
        return self.recovery.enabled

    @property
    def fallback_events(self) -> list[dict]:
        return self.recovery.events

    def check_health(self) -> None:
        """Raise :class:`DelegateError` if a link is unusable: with fallback, only when its peer did not
        take part in the recovery; without, when any delegate died, failed or froze."""
        if self._closed:
            raise DelegateError("delegate pool is closed")
        for link in self.links():
            self.recovery.check(link)

    # ------------------------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, direction: str, seq: int, due_ns: int = 0):
        """Queue message ``seq`` of channel (this rank → ``dst``, ``direction``).  Returns once the bytes
        are in a slot (CPU) or the D2H copy + signal are enqueued (CUDA), or, when the ring is full, once
        the message is queued for the send pump (sendpath.py); never waits for the link or a slot.
        ``due_ns``: its delegate sends it no earlier than this ``time.monotonic_ns()`` (an injected link
        delay, :meth:`~titan_ext.runtime.emulate.delay_injection.LinkDelayInjector.delegated_due_ns`).

        With fallback on, the pool keeps a reference to ``tensor`` until the peer acknowledges the
        message (do not modify it in place before), and while the link's delegate is being replaced
        the message goes over the direct path (the returned handle then waits like a direct send)."""
        return self.sender.send(tensor, dst, direction, seq, due_ns)

    def set_link_delay_ms(self, dst: int, direction: str, ms: float) -> None:
        """Inject a one-way delay on this rank's outgoing delegate link (tests and benchmarks): each
        message is sent ``ms`` after it was queued (a latency: messages in flight overlap)."""
        self.sender.set_link_delay_ms(dst, direction, ms)

    def post_recv(self, tensor: torch.Tensor, src: int, direction: str, seq: int) -> Recv:
        """Post the receive of message ``seq`` of channel (``src`` → this rank, ``direction``) into
        ``tensor``; its ``wait()`` on the posting thread returns once the data is there (CPU) or once the
        current stream waits for it (CUDA: on the copy's event, or on the device flag of a message not
        yet arrived — the host never waits for the message; recvpath.py)."""
        return self.receiver.post_recv(tensor, src, direction, seq)

    def poll(self, src: int, direction: str, seq: int) -> bool:
        """Has message ``seq`` (posted) arrived on the delegate path?  Never blocks."""
        return self.receiver.poll(src, direction, seq)

    def arrived(self, src: int, direction: str, seq: int) -> bool:
        """Did message ``seq`` show up on the delegate path before its receive was posted?  Never blocks."""
        return self.receiver.arrived(src, direction, seq)

    def cancel(self, src: int, direction: str, seq: int) -> None:
        """Forget a posted receive that was satisfied elsewhere (primary path); a later delegate copy
        of it is dropped as a duplicate."""
        self.receiver.cancel(src, direction, seq)

    def enable_fallback(self, group=None) -> None:
        """A dead or frozen delegate no longer stops training: its lane falls back to direct P2P on
        ``group`` (None: the default group; peers are global ranks) with no message lost or repeated, a
        new delegate is started in the background and the lane returns to it (recovery.py).  Call it on
        both ends of every channel (P2PRouter does), before the first message."""
        self.recovery.enable(group)

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
        return self.procs.pids() if hasattr(self, "procs") else []

    def close(self, grace_s: float = 5.0) -> None:
        """Stop the delegates: send delegates first drain what is queued (up to ``grace_s``), then all
        are terminated.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.procs.closed = True
        sender, receiver = getattr(self, "sender", None), getattr(self, "receiver", None)
        if sender is not None:   # messages queued for a full ring go into it first (the pump writes them)
            sender.flush(grace_s)
        self.recovery.stop()     # the supervisor tells the peers this pool is closing: no recovery then
        self.procs.stop(grace_s)
        for part in (sender, receiver):
            if part is not None:
                part.close()
        self.recovery.release()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        _live_pools.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
