"""The send path of a delegate pool: a message into its link's ring (CPU copy, or async D2H + signal on
the pool's D2H stream), or onto the direct path while the link's delegate is being replaced
(docs/delegate.md; the protocol: recovery.py)."""

from __future__ import annotations

import time

import torch

from . import ring as R
from ._device import D2H_STREAM, refuse_capture
from .link import DOWN, UP, DelegateError, Link, LinkDown

__all__ = ["SendPath"]


class Done:
    """Handle of a send that is already in its slot (CPU copy) or enqueued behind a signal (CUDA)."""

    def wait(self, timeout=None) -> bool:  # noqa: ARG002
        return True

    def is_completed(self) -> bool:
        return True


class SendPath:
    """Send links of one pool by ``(peer, direction)``; ``recovery`` judges lane health and owns the
    direct path; ``layer``: the CUDA device layer (None on CPU)."""

    def __init__(self, links: dict[tuple[int, str], list[Link]], recovery, layer, timeout_s: float):
        self.links, self.recovery, self.layer, self.timeout_s = links, recovery, layer, timeout_s
        self.stream = layer.stream(D2H_STREAM) if layer is not None else None
        self.delay_ns: dict[tuple[int, str], int] = {}  # set_link_delay_ms

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
        if not rec.enabled:
            return self.ring_send(link, link.lane, tensor, seq, due_ns)
        while True:
            with link.mutex:
                if link.error:
                    raise DelegateError(link.error)
                if link.state == DOWN and rec.spare_ready(link):
                    rec.switch_send(link, seq)
                if link.state == UP:
                    try:
                        handle = self.ring_send(link, link.lane, tensor, seq, due_ns)
                    except LinkDown:
                        continue
                    link.keep(seq, tensor, link.lane.ring.region.load64(R.CTRL_ACKED))
                    return handle
                if link.state == DOWN:  # callers may drop send handles: recovery keeps it until done
                    return rec.send_down(link, tensor, seq)
            time.sleep(0.005)  # RECOVERING: the supervisor is agreeing on the replay point

    def ring_send(self, link: Link, lane, tensor: torch.Tensor, seq: int, due_ns: int = 0):
        ring, i = lane.ring, lane.cursor
        if ring.state(i) != R.FREE:  # ring full: back-pressure (add lanes/slots if this shows up)
            self.recovery.wait_slot(link, lane, i, R.FREE, self.timeout_s, f"a free send slot (seq {seq})")
        self.recovery.lane_ok(link, lane)
        ring.set_state(i, R.WRITING, wake=False)
        nbytes = ring.write_header(i, seq, tensor, due_ns)
        if tensor.is_cuda:
            src = tensor.contiguous()
            with self.layer.context():
                self.stream.wait_stream(torch.cuda.current_stream(self.layer.device))
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
