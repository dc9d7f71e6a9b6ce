"""Receive matching of a delegate pool: the training process takes messages from its links' rings in
arrival order and matches them to posted receives by sequence number — an early arrival stays in its
(pinned) ring slot until its receive is posted, a duplicate (a failover retry of a message that also got
through) is dropped (docs/delegate.md; the direct-window part of the protocol: recovery.py).

The training thread never waits for a message.  On CUDA, with NCCL's ``Work.wait()`` as the
model (ProcessGroupNCCL makes the *current stream* wait on the work's end event and returns; the host
runs on):

* whoever takes a message from the ring (an arrival watcher polling ``is_completed()``, the training
  thread posting a receive whose message came early, the receive pump) enqueues its H2D on the pool's
  H2D stream — behind an event the consumer stream recorded when the receive was posted (the buffer's
  earlier readers are done; never a ``wait_stream`` at take time, which would wait for everything the
  host enqueued since, the consumer's own stream wait included) — and records an event after it.  No
  thread but the consumer's touches the consumer's stream;
* the consumer's wait (``Recv.wait()`` on the training thread, just before the compute that reads the
  data, as the device layer places it) makes the current stream wait on that event; a message not yet
  in the ring gets a device-side wait instead — the extension's spin-wait kernel on a device flag word
  (``stream_wait_flag``), which the copy's signal kernel sets (``h2d_signal``) — and the receive pump
  thread takes the message when it lands.  The host returns at once either way.

On a CPU stage the host is the device: a receive lands when its message is taken (a host copy), and the
consumer's wait blocks until then.  Under a simulated device that runs behind the host (the tests'
lagging device, registered through ``_device.register_stream_wait``) the consumer's wait also stalls
that device's stream until the message is taken; the host still waits for the data, because that device's data is
computed by the host in program order — a dependency of the simulation, as for ``nccl_rules``'
``Work.wait()``, not a host sync.
"""

from __future__ import annotations

import collections
import threading
import time

import torch

from . import ring as R
from ._device import H2D_STREAM, refuse_capture, side_context, stream_wait
from ._ext import load_ext
from .link import UP, DelegateError, Link, LinkDown, silent_peer

__all__ = ["Recv", "RecvMatcher"]

POLL_SLICE_S = 0.05   # a waiting receive re-checks whether another thread took its message this often
FLAG_WORDS = 64       # device flag words allocated at a time for consumer waits on messages not yet arrived
LAND_POLL_S = (20e-6, 500e-6)  # a side thread's wait for an H2D to finish polls its event this often


class Recv:
    """A posted delegate-path receive.  ``wait()`` is the consumer's wait (see the module docstring);
    ``is_completed()`` tells whether its message was taken from the ring (CPU: copied into ``tensor``;
    CUDA: its copy enqueued — the arrival the device layer stamps) and never blocks."""

    def __init__(self, matcher: "RecvMatcher", key, seq: int, tensor: torch.Tensor):
        self.matcher, self.key, self.seq, self.tensor = matcher, key, seq, tensor
        self.owner = threading.get_ident()  # the posting (training) thread: its wait is the consumer's
        self.done = False        # taken from the ring: copied into ``tensor`` (CPU) or its H2D enqueued (CUDA)
        self.waited = False      # the consumer's wait was placed
        self.error: BaseException | None = None
        # CUDA
        self.free_ev = None      # recorded on the consumer stream at posting: the buffer's readers are done
        self.target = None       # a contiguous staging buffer when ``tensor`` is not contiguous
        self.event = None        # recorded on the H2D stream after the copy
        self.flag = None         # (words, index, token): the word the copy signals (a late message's
        #                          consumer stream spins on it; else the slot's own word)

    def wait(self, timeout: float | None = None) -> bool:
        if not self.waited:
            self.matcher.wait(self, self.matcher.timeout_s if timeout is None else timeout)
        return True

    def is_completed(self) -> bool:
        if not self.done:
            self.matcher.drain(self.key)
        if self.error is not None:
            raise self.error
        return self.done


class _FlagWords:
    """Device flag words the consumer stream spins on when its message is not in the ring yet.

    Each wait takes a word and a fresh token; the copy's signal kernel writes the token.  A word is
    reused only once the event recorded right after its spin-wait kernel has completed (``query()``, no
    wait): the kernel compares for equality, so a word overwritten before its spinner saw the token
    would spin forever.  New words are zeroed on the H2D stream (where the signals run) and the calling
    (compute) stream then waits for the H2D stream, so no spinner reads a word before its memset.  Never
    the other way round: an H2D stream that waited for the compute stream's tail would wait behind the
    spin-waits already there, for copies queued behind it — a deadlock."""

    def __init__(self, layer, h2d_stream):
        self.layer, self.h2d_stream = layer, h2d_stream
        self.free: list[tuple[torch.Tensor, int]] = []
        self.busy: collections.deque = collections.deque()   # (words, index, event after the spinner)
        self.blocks: list[torch.Tensor] = []                 # every block stays allocated (spinners read it)
        self.token = 0

    def _grow(self) -> None:
        with torch.cuda.stream(self.h2d_stream):
            words = torch.zeros(FLAG_WORDS, dtype=torch.int32, device=self.layer.device)
        torch.cuda.current_stream(self.layer.device).wait_stream(self.h2d_stream)
        self.blocks.append(words)
        self.free += [(words, k) for k in range(FLAG_WORDS)]

    def take(self) -> tuple[torch.Tensor, int, int]:
        while self.busy and self.busy[0][2].query():
            words, k, _ = self.busy.popleft()
            self.free.append((words, k))
        if not self.free:
            self._grow()
        words, k = self.free.pop()
        self.token = self.token % 0x7FFFFFFF + 1   # 1 .. 2^31-1: never the zeroed value
        return words, k, self.token

    def spun(self, words: torch.Tensor, k: int, stream) -> None:
        ev = torch.cuda.Event()
        ev.record(stream)
        self.busy.append((words, k, ev))


class RecvMatcher:
    """Receive links of one pool by ``(peer, direction)`` and the matching state.  ``lock`` guards the
    tables (receives are taken by other threads — arrival watchers, the receive pump, the supervisor)
    and is never held while blocking; ``recovery`` judges lane health and receives in a link's direct
    window.  Built on the training thread: side threads make their device calls under the context
    captured here (:func:`side_context`)."""

    def __init__(self, links: dict[tuple[int, str], list[Link]], recovery, lock, layer, timeout_s: float):
        self.links, self.recovery, self.lock, self.layer, self.timeout_s = links, recovery, lock, layer, timeout_s
        self.context = side_context(layer)
        self.stream = layer.stream(H2D_STREAM) if layer is not None else None
        self.flags = _FlagWords(layer, self.stream) if layer is not None else None
        self._pending: dict[tuple[int, str], dict[int, Recv]] = {k: {} for k in links}
        self._early: dict[tuple[int, str], dict[int, tuple]] = {k: {} for k in links}  # seq -> (lane, i, dtype, shape)
        self._consumed: dict[tuple[int, str], set[int]] = {k: set() for k in links}
        self._floor: dict[tuple[int, str], int] = {}
        self._late: collections.deque[Recv] = collections.deque()   # consumer waits placed before arrival
        self._pump_cv = threading.Condition()
        self._pump: threading.Thread | None = None
        self._closed = False

    # --- API (DelegatePool's) ------------------------------------------------------------------------
    def post_recv(self, tensor: torch.Tensor, src: int, direction: str, seq: int) -> Recv:
        key = (src, direction)
        if key not in self.links:
            raise KeyError(f"no recv-{direction} delegates from rank {src} in this pool")
        h = Recv(self, key, seq, tensor)
        if tensor.is_cuda:
            refuse_capture("DelegatePool.post_recv")
            with self.layer.context():
                consumer = torch.cuda.current_stream(self.layer.device)
                if not tensor.is_contiguous():
                    h.target = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
                h.free_ev = torch.cuda.Event()
                h.free_ev.record(consumer)   # the H2D writes the buffer once its earlier readers are done
        with self.lock:
            early = self._early[key].pop(seq, None)
            if early is not None:
                self._land(key, h, *early)
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
            early = self._early[key].pop(seq, None)
            if early is not None:
                early[0].ring.set_state(early[1], R.FREE)
            self._mark_consumed(key, seq)

    def close(self) -> None:
        with self._pump_cv:
            self._closed = True
            self._pump_cv.notify_all()

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
        """``h`` was received (on the direct path, by the calling thread); caller holds the lock."""
        if h.tensor.is_cuda:
            with self.context():   # the copy is ordered on this thread's stream: the H2D stream follows it
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(self.layer.device))
                if h.flag is not None:   # a consumer stream already spins on the flag
                    self.stream.wait_event(ev)
                    with torch.cuda.stream(self.stream):
                        self._word(h).fill_(self._token(h))
                h.event = ev
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

    def wait(self, h: Recv, timeout_s: float) -> None:
        """``Recv.wait()``.  On the posting thread it is the consumer's wait (module docstring); on any
        other thread (the device layer's watcher where a backend's wait must land the data: gloo) it
        waits, on that thread, until the data is in the buffer, and touches no stream."""
        owner = threading.get_ident() == h.owner
        if owner and h.tensor.is_cuda:
            self._consumer_wait_cuda(h)
        else:  # a CPU stage (the host is the device), or a side thread: wait here until the data is there
            wait = stream_wait() if owner else None
            if wait is not None:   # a simulated device's stream stalls here until the message is taken
                wait(lambda: h.done, f"delegate receive {h.seq} from rank {h.key[0]} ({h.key[1]})")
            self.complete(h, timeout_s)
            if h.tensor.is_cuda:
                self._until_copied(h)
        h.waited = True

    def _consumer_wait_cuda(self, h: Recv) -> None:
        ext = load_ext()
        with self.layer.context():
            consumer = torch.cuda.current_stream(self.layer.device)
            with self.lock:
                self.drain(h.key)   # a message that has landed meanwhile goes up now (from this thread)
                if h.error is not None:
                    raise h.error
                if h.done:
                    consumer.wait_event(h.event)
                    return
                h.flag = self.flags.take()
                with torch.cuda.stream(consumer):
                    ext.stream_wait_flag(self._word(h), self._token(h))   # the device waits, the host goes on
                self.flags.spun(h.flag[0], h.flag[1], consumer)
            self._await_late(h)

    def _await_late(self, h: Recv) -> None:
        """Hand ``h`` to the receive pump: its stream waits on the device, something must take it."""
        with self._pump_cv:
            self._late.append(h)
            if self._pump is None:
                self._pump = threading.Thread(target=self._pump_loop, daemon=True, name="titan_ext-delegate-recv-pump")
                self._pump.start()
            self._pump_cv.notify()

    def _pump_loop(self) -> None:
        """Takes the messages consumer streams wait for on the device, in the order their waits were
        placed (the compute stream reaches them in that order): blocks this thread only."""
        with self.context():
            while True:
                with self._pump_cv:
                    while not self._late and not self._closed:
                        self._pump_cv.wait()
                    if self._closed:
                        return
                    h = self._late[0]
                try:
                    self.complete(h, self.timeout_s)
                except BaseException as exc:  # noqa: BLE001 - raised by the next is_completed()/wait() of it
                    h.error = exc
                with self._pump_cv:
                    self._late.popleft()

    def _until_copied(self, h: Recv) -> None:
        """A side thread: wait (polling the copy's event, no sync) until the H2D of ``h`` finished."""
        pause = LAND_POLL_S[0]
        with self.context():
            while not h.event.query():
                time.sleep(pause)
                pause = min(2 * pause, LAND_POLL_S[1])

    def complete(self, h: Recv, timeout_s: float) -> None:
        """Block the calling thread until ``h`` is taken (a CPU stage's consumer, the receive pump, a
        side thread)."""
        links = self.links[h.key]
        link = links[h.seq % len(links)]
        deadline = time.monotonic() + timeout_s
        what = f"message {h.seq} from rank {h.key[0]} ({h.key[1]})"
        while True:
            with self.lock:
                self.drain(h.key)
                if h.error is not None:
                    raise h.error
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
            self._land(key, h, lane, i, dtype, shape)
        elif self._is_consumed(key, seq):  # duplicate (failover retry of a message that made it): drop
            ring.set_state(i, R.FREE)
        else:  # arrived before its receive was posted: it stays in its pinned slot (BUSY) until then
            self._early[key][seq] = (lane, i, dtype, shape)

    def _land(self, key, h: Recv, lane, i: int, dtype, shape) -> None:
        """Message ``h.seq`` is in slot ``i``: copy it into the receive (caller holds the lock)."""
        t = h.tensor
        if t.dtype != dtype or tuple(t.shape) != tuple(shape):
            lane.ring.set_state(i, R.FREE)
            raise DelegateError(f"message {h.seq} from rank {key[0]}: got {dtype}{list(shape)}, "
                                f"receive posted for {t.dtype}{list(t.shape)}")
        if t.is_cuda:
            self.h2d(lane, i, h)
        else:
            self._copy_slot(lane, i, h)
        h.done = True
        self._mark_consumed(key, h.seq)

    @staticmethod
    def _copy_slot(lane, i: int, h: Recv) -> None:
        """CPU: copy slot ``i`` into the receive's buffer and free the slot."""
        t = h.tensor
        with torch.no_grad():  # receive buffers of pipeline stages are leaves that require grad
            nbytes = t.numel() * t.element_size()
            if nbytes:
                lane.ring.copy_out(i, t, nbytes)
        lane.ring.set_state(i, R.FREE)

    @staticmethod
    def _word(h: Recv) -> torch.Tensor:
        """The device flag word the copy of ``h`` signals (a one-element int32 view)."""
        words, k, _ = h.flag
        return words[k:k + 1]

    @staticmethod
    def _token(h: Recv) -> int:
        return h.flag[2]

    @staticmethod
    def _target(h: Recv) -> torch.Tensor:
        """Where the H2D writes: the receive's buffer, or its contiguous staging buffer."""
        return h.target if h.target is not None else h.tensor

    def h2d(self, lane, i: int, h: Recv) -> None:
        """Async H2D of slot ``i`` into ``h``'s buffer on the H2D stream, from any thread (under the
        context captured on the training thread); the copy's kernel frees the slot and sets the device
        flag a consumer stream may already spin on; an event after it is what a later consumer waits on.
        The consumer's stream is never touched here (see the module docstring)."""
        ring = lane.ring
        dst: torch.Tensor = h.tensor
        target = self._target(h)
        if h.flag is None:  # nobody spins yet: the signal goes to the slot's own word
            lane.tokens[i] = (lane.tokens[i] + 1) & 0x7FFFFFFF
            h.flag = (lane.dev_flags, i, lane.tokens[i])
        with self.context():
            s = self.stream
            s.wait_event(h.free_ev)   # the buffer's readers enqueued before the receive was posted are done
            with torch.cuda.stream(s):
                target.record_stream(s)
                ring.region.h2d_signal(ring.geometry.slot_offset(i) + R.SLOT_PAYLOAD, target,
                                       ring.state_offset(i), R.FREE, self._word(h), self._token(h))
                with torch.no_grad():
                    if target is not dst:
                        dst.copy_(target, non_blocking=True)   # device to device, on the H2D stream
                ev = torch.cuda.Event()
                ev.record(s)
            h.event = ev
