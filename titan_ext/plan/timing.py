"""Shared timing primitives of the planners and the simulator (DESIGN.md "Timing model").

All arithmetic is in integer nanoseconds so that event times compare exactly (no float ties).
A message on a link takes ``latency + size/bandwidth``; each direction of a link carries one message
at a time (range-based occupancy, CrossPipe §4.2.3): a message's transmission window of length
``size/bandwidth`` starts when both the message and the link direction are ready, and the message
arrives ``latency`` after its window ends.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from .profile import LinkProfile

NS_PER_MS = 1_000_000


def to_ns(ms: float) -> int:
    return int(round(ms * NS_PER_MS))


def to_ms(ns: int) -> float:
    return ns / NS_PER_MS


class LinkQueues:
    """FIFO occupancy of every (link, direction): ``send`` returns a message's arrival time."""

    __slots__ = ("latency_ns", "transfer_ns", "_free")

    def __init__(self, links: Sequence[LinkProfile]):
        self.latency_ns = [to_ns(link.latency_ms) for link in links]
        self.transfer_ns = [to_ns(link.transfer_ms) for link in links]
        self._free: dict[Hashable, int] = {}

    def send(self, link: int, channel: Hashable, ready_ns: int) -> int:
        """Send one message over ``link`` on ``channel`` (one FIFO per direction), ready at ``ready_ns``."""
        tx = self.transfer_ns[link]
        if tx == 0:
            return ready_ns + self.latency_ns[link]
        start = max(ready_ns, self._free.get(channel, 0))
        self._free[channel] = start + tx
        return start + tx + self.latency_ns[link]
