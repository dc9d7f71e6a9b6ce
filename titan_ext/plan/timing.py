"""The one definition of link timing (DESIGN.md "Timing model").

All arithmetic is in integer nanoseconds so that event times compare exactly (no float ties).
A message on a link takes ``latency + size/bandwidth`` (the α-β model, CrossPipe §2.2). Each direction
of a link ("channel") transmits one message at a time, **first in, first out**: a message's
transmission window of length ``size/bandwidth`` starts when the message is ready and every message
sent before it on that channel has left, and the message arrives ``latency`` after its window ends.

FIFO, not gap-filling, is the decision: it is what a transport does (one send stream per peer, in
issue order), and it is what this class implements. CrossPipe's greedy as published (§4.2.3) reserves
the earliest free window at or after the ready time ("range-based occupancy", which can fill a gap
before a window booked earlier). The two agree on every plan our evaluators time, because every
message on a channel is sent by one rank — the one on its near side — in that rank's program order,
so ready times per channel never decrease and no gap can precede a later message; so
``crosspipe.greedy`` sends through this class too (tests/plan/test_crosspipe_greedy.py checks the two rules
agree on such sends). Callers: ``simulate`` (the reference), ``replay_makespan_ns``, the PipeMorph and
virtual generators, CrossPipe's greedy. The C modules send through ``_link.h``, this ``send`` in C, in the
same integer ns (``_pipemorph.c``, ``_greedy.c``, ``_search.c``); the one other copy is the pure-Python
reference of ``_search.c``, ``crosspipe.retime.Retimer._loop``, which keeps the six lines inline in its
inner loop. All are checked bit-for-bit against ``simulate`` by ``tests/plan/test_plan_reference.py``.
"""

from __future__ import annotations

import math
from typing import Hashable, Sequence

from .profile import LinkProfile

NS_PER_MS = 1_000_000


def bubble_rate(busy: float, ranks: int, span: float) -> float:
    """The one definition of a timeline's bubble rate (DESIGN.md): 1 − Σ busy / (P · T), with ``busy`` the
    summed busy time of the ``ranks`` = P ranks and ``span`` = T in the same unit; NaN when T is not positive.
    Used by the simulator, the runtime's exchanged timeline and TorchTitan's step monitor."""
    return 1.0 - busy / (ranks * span) if span > 0 else math.nan


def to_ns(ms: float) -> int:
    return int(round(ms * NS_PER_MS))


def to_ms(ns: int) -> float:
    return ns / NS_PER_MS


class LinkQueues:
    """FIFO occupancy of every channel (link direction): ``send`` returns a message's arrival time."""

    __slots__ = ("latency_ns", "transfer_ns", "_free", "_last")

    def __init__(self, links: Sequence[LinkProfile]):
        self.latency_ns = [to_ns(link.latency_ms) for link in links]
        self.transfer_ns = [to_ns(link.transfer_ms) for link in links]
        self._free: dict[Hashable, int] = {}
        self._last: dict[Hashable, int] = {}  # send_timed: a channel's last arrival

    def send(self, link: int, channel: Hashable, ready_ns: int) -> int:
        """Send one message over ``link`` on ``channel`` (one FIFO per direction), ready at ``ready_ns``."""
        tx = self.transfer_ns[link]
        if tx == 0:
            return ready_ns + self.latency_ns[link]
        start = max(ready_ns, self._free.get(channel, 0))
        self._free[channel] = start + tx
        return start + tx + self.latency_ns[link]

    def send_timed(self, channel: Hashable, ready_ns: int, latency_ns: int, transfer_ns: int) -> int:
        """:meth:`send` for a message with its own latency and transfer time (its size, and a link whose
        parameters change over time: the delay injector and the delegates' arrival,
        ``runtime/emulate/delay_injection.py``). The same FIFO per channel — the window starts when the
        message is ready and the channel's earlier windows have ended, also for a message that takes no
        time on the wire —, and since a later message may now have a shorter latency, it is delivered
        no earlier than the channel's previous one (FIFO delivery). With one latency and transfer time
        per link and ready times that never decrease on a channel (every plan: module docstring) this
        is :meth:`send`, arrival for arrival (tests/runtime/test_runtime_link_rule.py)."""
        start = max(ready_ns, self._free.get(channel, ready_ns))
        self._free[channel] = start + transfer_ns
        arrival = max(start + transfer_ns + latency_ns, self._last.get(channel, ready_ns))
        self._last[channel] = arrival
        return arrival
