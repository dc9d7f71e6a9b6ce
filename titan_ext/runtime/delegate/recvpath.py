"""Receive matching of a delegate pool: the training process takes messages from its links' rings in
arrival order and matches them to posted receives by sequence number — an early arrival is kept aside
until its receive is posted, a duplicate (a failover retry of a message that also got through) is
dropped; on CUDA the payload goes up on the pool's H2D stream and the consumer's stream waits on a
device flag (docs/delegate.md; the direct-window part of the protocol: recovery.py)."""

from __future__ import annotations

import time

import torch

from . import ring as R
from ._device import H2D_STREAM, refuse_capture
from ._ext import load_ext
from .link import UP, DelegateError, Link, LinkDown, silent_peer

__all__ = ["Recv", "RecvMatcher"]

POLL_SLICE_S = 0.05   # a waiting receive re-checks whether another thread took its message this often


class Recv:
    """A posted delegate-path receive; ``wait()`` copies the message into ``tensor``."""

    def __init__(self, matcher: "RecvMatcher", key, seq: int, tensor: torch.Tensor):
        self.matcher, self.key, self.seq, self.tensor = matcher, key, seq, tensor
        self.done = False
        self.stream = None

    def wait(self, timeout: float | None = None) -> bool:
        if not self.done:
            self.matcher.complete(self, self.matcher.timeout_s if timeout is None else timeout)
        return True

    def is_completed(self) -> bool:
        if not self.done:
            self.matcher.drain(self.key)
        return self.done


class RecvMatcher:
    """Receive links of one pool by ``(peer, direction)`` and the matching state.  ``lock`` guards the
    tables (receives are waited on by other threads — arrival watchers) and is never held while
    blocking; ``recovery`` judges lane health and receives in a link's direct window."""

    def __init__(self, links: dict[tuple[int, str], list[Link]], recovery, lock, layer, timeout_s: float):
        self.links, self.recovery, self.lock, self.layer, self.timeout_s = links, recovery, lock, layer, timeout_s
        self.stream = layer.stream(H2D_STREAM) if layer is not None else None
        self._pending: dict[tuple[int, str], dict[int, Recv]] = {k: {} for k in links}
        self._early: dict[tuple[int, str], dict[int, torch.Tensor]] = {k: {} for k in links}
        self._consumed: dict[tuple[int, str], set[int]] = {k: set() for k in links}
        self._floor: dict[tuple[int, str], int] = {}

    # --- API (DelegatePool's) ------------------------------------------------------------------------
    def post_recv(self, tensor: torch.Tensor, src: int, direction: str, seq: int) -> Recv:
        key = (src, direction)
        if key not in self.links:
            raise KeyError(f"no recv-{direction} delegates from rank {src} in this pool")
        h = Recv(self, key, seq, tensor)
        if tensor.is_cuda:
            refuse_capture("DelegatePool.post_recv")
            h.stream = torch.cuda.current_stream(self.layer.device)  # the consumer's stream waits on the signal
        with self.lock:
            early = self._early[key].pop(seq, None)
            if early is not None:
                self._copy_out(h, early)
            elif self._is_consumed(key, seq):
                raise DelegateError(f"message {seq} from rank {src} ({direction}) was already received")
            else:
                self._pending[key][seq] = h
        return h

    def poll(self, src: int, direction: str, seq: int) -> bool:
        key = (src, direction)
        with self.lock:
            self.drain(key)
            h = self._pending[key].get(seq)
            if h is None:
                return self._is_consumed(key, seq) or seq in self._early[key]
            return h.done

    def arrived(self, src: int, direction: str, seq: int) -> bool:
        """Did ``seq`` show up on the delegate path before its receive was posted here?"""
        key = (src, direction)
        with self.lock:
            self.drain(key)
            return seq in self._early[key]

    def cancel(self, src: int, direction: str, seq: int) -> None:
        key = (src, direction)
        with self.lock:
            self._pending[key].pop(seq, None)
            self._early[key].pop(seq, None)
            self._mark_consumed(key, seq)

    # --- for recovery ----------------------------------------------------------------------------------
    def take_ready(self, link: Link) -> None:
        """Take every complete (READY) message at the head of the link's ring (a dead one: its last)."""
        key, lane = (link.peer, link.channel.direction), link.lane
        with self.lock:
            while lane.ring.state(lane.cursor) == R.READY:
                self._take(key, link, lane, lane.cursor)

    def forget(self, key, seq: int) -> None:
        with self.lock:
            self._pending[key].pop(seq, None)

    def finish(self, h: Recv) -> None:
        """``h`` was received (on the direct path); caller holds the lock."""
        h.done = True
        self._mark_consumed(h.key, h.seq)

    # --- matching ----------------------------------------------------------------------------------------
    def _mark_consumed(self, key, seq: int) -> None:
        consumed = self._consumed[key]
        consumed.add(seq)
        if len(consumed) > 4096:  # keep a window: retries are never that far behind
            floor = max(consumed) - 2048
            self._consumed[key] = {s for s in consumed if s >= floor}
            self._floor[key] = max(self._floor.get(key, -1), floor)

    def _is_consumed(self, key, seq: int) -> bool:
        return seq in self._consumed[key] or seq < self._floor.get(key, -1)

    def complete(self, h: Recv, timeout_s: float) -> None:
        links = self.links[h.key]
        link = links[h.seq % len(links)]
        deadline = time.monotonic() + timeout_s
        what = f"message {h.seq} from rank {h.key[0]} ({h.key[1]})"
        while True:
            with self.lock:
                self.drain(h.key)
                if h.done:
                    return
                if link.error:
                    raise DelegateError(link.error)
                state, lane, direct = link.state, link.lane, link.in_window(h.seq)
                i = lane.cursor
            if direct:
                if self.recovery.recv_direct(link, h):
                    return
                continue  # the window closed before h.seq: it comes from the new delegate
            if time.monotonic() > deadline:
                raise silent_peer(h.key[0], what, timeout_s, lane)
            if state != UP:
                time.sleep(0.005)  # RECOVERING: the supervisor is taking what the dead ring holds
                continue
            try:  # block without the lock until the lane's next slot is READY — in short slices: another
                # thread (an arrival watcher polling is_completed()) may take the message meanwhile
                self.recovery.wait_slot(link, lane, i, R.READY, POLL_SLICE_S, what, raise_on_timeout=False)
            except LinkDown:
                continue

    def drain(self, key) -> None:
        """Take every READY message at the head of the channel's live lanes."""
        with self.lock:
            for link in self.links[key]:
                if link.state != UP:
                    continue  # recovery takes what a dead ring holds (Recovery.recover_recv)
                lane = link.lane
                while lane.ring.state(lane.cursor) == R.READY:
                    self._take(key, link, lane, lane.cursor)

    def _take(self, key, link: Link, lane, i: int) -> None:
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
                    self.h2d(lane, i, t, h.stream)
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

    def _copy_out(self, h: Recv, data: torch.Tensor) -> None:
        if h.tensor.dtype != data.dtype or tuple(h.tensor.shape) != tuple(data.shape):
            raise DelegateError(f"message {h.seq}: got {data.dtype}{list(data.shape)}, "
                                f"receive posted for {h.tensor.dtype}{list(h.tensor.shape)}")
        with torch.no_grad():  # receive buffers of pipeline stages are leaves that require grad
            h.tensor.copy_(data)
        h.done = True
        self._mark_consumed(h.key, h.seq)

    def h2d(self, lane, i: int, dst: torch.Tensor, consumer) -> None:
        """Async H2D of slot ``i`` into ``dst`` on the H2D stream; the consumer's stream waits on the
        device flag the copy's kernel sets (any thread: all under the device layer's context)."""
        ring = lane.ring
        ext = load_ext()
        target = dst if dst.is_contiguous() else torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
        lane.tokens[i] = (lane.tokens[i] + 1) & 0x7FFFFFFF
        flag = lane.dev_flags[i:i + 1]
        with self.layer.context():  # may run on an arrival-watcher thread
            self.stream.wait_stream(consumer)
            with torch.cuda.stream(self.stream):
                target.record_stream(self.stream)
                ring.region.h2d_signal(ring.geometry.slot_offset(i) + R.SLOT_PAYLOAD, target,
                                       ring.state_offset(i), R.FREE, flag, lane.tokens[i])
            with torch.cuda.stream(consumer):
                ext.stream_wait_flag(flag, lane.tokens[i])  # the consumer stream waits on the device signal
                if target is not dst:
                    dst.copy_(target)
