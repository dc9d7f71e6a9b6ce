"""The vocabulary the delegate pool's parts share: a link and its states, route markers, direct-path
tags, the pool's errors (docs/delegate.md).  Imports nothing of the pool, so the parts (lanes.py,
sendpath.py, recvpath.py, recovery.py, pool.py) import it and not each other."""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch

from ..timeouts import PeerTimeout, _fence

UP, RECOVERING, DOWN = "up", "recovering", "down"
DIRECT, DELEGATE = 0, 1      # route markers
TAG_BASE = 1 << 20           # above any tag the schedules use


def tag(direction: str, seq: int, data: bool) -> int:
    """Direct-path tag of message ``seq``'s route marker (data=False) or payload (data=True)."""
    return TAG_BASE + 4 * seq + 2 * (direction == "B") + int(data)


class DelegateError(RuntimeError):
    """A delegate process died or failed, or a delegate-path message did not arrive in time."""


class DelegateTimeout(DelegateError, PeerTimeout):
    """A delegate-path wait on a peer rank ended at the timeout (the message names the rank)."""


def silent_peer(peer: int, what: str, timeout_s: float, lane: Any) -> DelegateTimeout:
    """The error of a delegate-path wait on ``peer`` that ended at the timeout: it names the rank and, as
    without delegation (``timeouts``), fences it when it is a stopped process on this host (torchrun
    cannot end a stopped worker with SIGTERM and waits 30 s more before its SIGKILL)."""
    import torch.distributed as dist

    me = dist.get_rank() if dist.is_available() and dist.is_initialized() else "?"
    return DelegateTimeout(f"rank {me}: timed out after {timeout_s:.1f} s waiting for {what} on {lane.describe()}: "
                           f"rank {peer} stopped answering{_fence(peer)}")


class LinkDown(Exception):
    """Internal: the link's delegate is gone or being replaced; take the fallback path."""


class Link:
    """One lane of one channel on this rank, across respawns of its delegate."""

    def __init__(self, channel, index: int, role: str, stride: int, lane: Any):
        self.channel, self.index, self.role, self.stride = channel, index, role, stride
        self.lane = lane                    # the delegate in use (UP), or the dead one (DOWN)
        self.spare: Any = None              # respawned delegate, not yet in use
        self.state = UP
        self.mutex = threading.Lock()       # send: ring write + keep vs. the replay snapshot; recv: routes
        self.retained: collections.deque = collections.deque()  # send: (seq, tensor) not yet acknowledged
        self.pending: collections.deque = collections.deque()   # send: messages waiting for a free slot
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
