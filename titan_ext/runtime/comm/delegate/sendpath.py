"""The send path of a delegate pool: a message into its link's ring (CPU copy, or async D2H + signal on
the pool's D2H stream), or onto the direct path while the link's delegate is being replaced
(docs/delegate.md; the protocol: recovery.py).

A send never blocks the training thread.  When the link's next slot is not free — the ring
is full: the delegate or the peer is behind, or, on a GPU, the peer's device has not yet copied earlier
messages out — the message is queued on its link (``Link.pending``, in order: a later message never
overtakes a queued one) and the pool's send pump thread writes it once the slot frees.  Why a queue and
not a ring sized so it cannot fill: the number of messages in flight on a link is not a property of the
plan alone — with the host running ahead of the device, a rank enqueues the sends of iterations its
device (and its peer's) has not run yet, and an adaptive schedule changes its plan — so no bound derived
from one plan holds; the queue costs nothing while the ring has room.  A queued message keeps a
reference to its tensor until it is in a slot (NCCL likewise reads a send buffer when its kernel runs,
not at ``isend``: do not modify it in place meanwhile).

On CUDA the D2H waits on an event the training thread recorded on the compute stream at the send
(``ready``): the data it sends is what the compute stream had produced there, whichever thread enqueues
the copy.
"""

from __future__ import annotations

import threading
import time

import torch

from . import ring as R
from ._device import D2H_STREAM, refuse_capture, side_context
from .link import DOWN, UP, DelegateError, Link, LinkDown

__all__ = ["SendPath"]

PUMP_SLICE_S = 0.001   # the send pump waits this long at most on one full ring before looking at the others


class Done:
    """Handle of a send that is in its slot, enqueued behind a signal (CUDA), or queued for a slot."""

    def wait(self, timeout=None) -> bool:  # noqa: ARG002
        return True

    def is_completed(self) -> bool:
        return True


class _Message:
    __slots__ = ("seq", "tensor", "due_ns", "ready")

    def __init__(self, seq: int, tensor: torch.Tensor, due_ns: int, ready=None):
        self.seq, self.tensor, self.due_ns, self.ready = seq, tensor, due_ns, ready


class SendPath:
    """Send links of one pool by ``(peer, direction)``; ``recovery`` judges lane health and owns the
    direct path; ``layer``: the CUDA device layer (None on CPU).  Built on the training thread: the send
    pump makes its device calls under the context captured here (``side_context``)."""

    def __init__(self, links: dict[tuple[int, str], list[Link]], recovery, layer, timeout_s: float):
        self.links, self.recovery, self.layer, self.timeout_s = links, recovery, layer, timeout_s
        self.stream = layer.stream(D2H_STREAM) if layer is not None else None
        self.context = side_context(layer)
        self.delay_ns: dict[tuple[int, str], int] = {}  # set_link_delay_ms
        self._cv = threading.Condition()
        self._queued: list[Link] = []     # links with pending messages (the pump's work)
        self._pump: threading.Thread | None = None
        self._closed = False
        self.queued_total = 0             # messages that found their ring full (stats, tests)

    def send(self, tensor: torch.Tensor, dst: int, direction: str, seq: int, due_ns: int = 0):
        """See :meth:`DelegatePool.send`."""
        delay = self.delay_ns.get((dst, direction), 0)
        if delay:
            due_ns = max(due_ns, time.monotonic_ns() + delay)
        links = self.links.get((dst, direction))
        if links is None:
            raise KeyError(f"no send-{direction} delegates to rank {dst} in this pool")
        if self.layer is not None:
            refuse_capture("DelegatePool.send")
        link, rec = links[seq % len(links)], self.recovery
        msg = self._message(tensor, seq, due_ns)
        while True:
            with link.mutex:
                if link.error:
                    raise DelegateError(link.error)
                if rec.enabled and link.state == DOWN and rec.spare_ready(link):
                    rec.switch_send(link, seq)
                if link.state == UP:
                    try:
                        self._put(link, msg)
                    except LinkDown:
                        continue
                    if rec.enabled:
                        link.keep(seq, msg.tensor, link.lane.ring.region.load64(R.CTRL_ACKED))
                    return Done()
                if link.state == DOWN:  # callers may drop send handles: recovery keeps it until done
                    return rec.send_down(link, msg.tensor, seq)
            time.sleep(0.005)  # RECOVERING: the supervisor is agreeing on the replay point

    def _message(self, tensor: torch.Tensor, seq: int, due_ns: int) -> _Message:
        """The message, with what its copy must wait for, captured on the sending (training) thread."""
        if tensor.is_cuda:
            with self.layer.context():
                src = tensor.contiguous()
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.layer.device))
            return _Message(seq, src, due_ns, ready)
        return _Message(seq, tensor, due_ns)

    def _put(self, link: Link, msg: _Message) -> None:
        """Into the link's next slot if it is free and nothing is queued before it; else queue it for
        the pump (caller holds ``link.mutex``)."""
        lane = link.lane
        if not link.pending and lane.ring.state(lane.cursor) == R.FREE:
            self.ring_send(link, lane, msg.tensor, msg.seq, msg.due_ns, msg.ready)
            return
        self.recovery.lane_ok(link, lane)   # a dead lane: LinkDown (fallback) or DelegateError, as a write
        link.pending.append(msg)
        self.queued_total += 1
        with self._cv:
            if link not in self._queued:
                self._queued.append(link)
            if self._pump is None:
                self._pump = threading.Thread(target=self._pump_loop, daemon=True, name="titan_ext-delegate-send-pump")
                self._pump.start()
            self._cv.notify()

    def _pump_loop(self) -> None:
        """Writes queued messages into their rings as slots free up, each link's in order."""
        with self.context():
            while True:
                with self._cv:
                    while not self._queued and not self._closed:
                        self._cv.wait()
                    if self._closed:
                        return
                    links = list(self._queued)
                if not any([self._drain(link) for link in links]):
                    lane = links[0].lane   # nothing could be written: wait a slice for a slot (or the device)
                    if lane.ring.wait_state(lane.cursor, R.FREE, PUMP_SLICE_S, R.CTRL_ERROR, 50) == 0:
                        time.sleep(PUMP_SLICE_S / 10)

    def _drain(self, link: Link) -> bool:
        """Write the link's queued messages while its slots are free; whether any was written."""
        wrote = False
        with link.mutex:
            while link.pending and link.state == UP and not link.error:
                lane, msg = link.lane, link.pending[0]
                if lane.ring.state(lane.cursor) != R.FREE:
                    break
                try:
                    self.ring_send(link, lane, msg.tensor, msg.seq, msg.due_ns, msg.ready)
                except LinkDown:
                    break   # the supervisor takes over: the message is retained and will be replayed
                except DelegateError as exc:   # no fallback: the link is unusable, the next send raises
                    link.error = str(exc)
                    link.pending.clear()
                    break
                link.pending.popleft()
                wrote = True
            with self._cv:
                if (not link.pending or link.error) and link in self._queued:
                    self._queued.remove(link)
        return wrote

    def ring_send(self, link: Link, lane, tensor: torch.Tensor, seq: int, due_ns: int = 0, ready=None):
        """Write message ``seq`` into the lane's next slot (FREE: the callers check; a caller that did not
        waits for it).  CUDA: an async D2H + READY signal on the D2H stream, behind ``ready`` (an event
        on the compute stream; None: the current stream's work so far — the caller is the training thread)."""
        ring, i = lane.ring, lane.cursor
        if ring.state(i) != R.FREE:
            self.recovery.wait_slot(link, lane, i, R.FREE, self.timeout_s, f"a free send slot (seq {seq})")
        self.recovery.lane_ok(link, lane)
        ring.set_state(i, R.WRITING, wake=False)
        nbytes = ring.write_header(i, seq, tensor, due_ns)
        if tensor.is_cuda:
            src = tensor.contiguous()
            with self.context():
                if ready is None:
                    self.stream.wait_stream(torch.cuda.current_stream(self.layer.device))
                else:
                    self.stream.wait_event(ready)
                with torch.cuda.stream(self.stream):
                    src.record_stream(self.stream)
                    ring.region.d2h_signal(src, ring.geometry.slot_offset(i) + R.SLOT_PAYLOAD,
                                           ring.state_offset(i), R.READY)
            lane.keep[i] = src
        else:
            if nbytes:
                ring.copy_in(i, tensor, nbytes)
            ring.set_state(i, R.READY)
        lane.cursor = (i + 1) % ring.num_slots
        return Done()

    def set_link_delay_ms(self, dst: int, direction: str, ms: float) -> None:
        if (dst, direction) not in self.links:
            raise KeyError(f"no send-{direction} delegates to rank {dst} in this pool")
        self.delay_ns[(dst, direction)] = int(round(ms * 1e6))

    def pending(self) -> int:
        """Messages queued for a full ring now."""
        return sum(len(link.pending) for links in self.links.values() for link in links)

    def flush(self, timeout_s: float) -> bool:
        """Wait (closing the pool: not a training-thread path) until no message is queued; whether so."""
        deadline = time.monotonic() + timeout_s
        while self.pending() and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self.pending()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
