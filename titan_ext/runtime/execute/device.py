"""The device layer: the one place where the runtime times compute, stamps message arrival, waits on
receives, allocates device buffers and picks streams and devices (DESIGN.md "GPU rules").

Three implementations behind one interface (:class:`DeviceLayer`):

* :class:`CpuDevice` — the host *is* the device: compute is synchronous, times are host-clock stamps,
  a receive's ``Work.wait()`` blocks until the data has landed (gloo).
* :class:`CudaDevice` — kernels and copies are asynchronous:

  - compute is timed with CUDA events recorded on the stage's compute stream and read *without a host
    sync on the critical path*: :meth:`Timer.resolve` with ``block=False`` only reads events that
    ``query()`` reports complete, and an iteration the device has not finished at the next one's start
    waits in a backlog for a later non-blocking resolve; a blocking resolve waits on the newest
    iteration's last event (never a device ``synchronize``) and is done only where the profile is
    needed now (the profile-exchange boundary, a logging step);
  - event times are put on the host clock through an *anchor*: an event whose host time is known, so a
    device backlog behind the host (the optimizer's kernels still running when the next iteration is
    enqueued) does not shift the timeline — a host clock read at *enqueue* of a compute-stream event
    would.  ``Event.elapsed_time`` is ``cudaEventElapsedTime``: a C ``float`` of
    milliseconds, whose spacing is 1 ms after 2.3 h and 8 ms after a day, so the anchor must be
    *recent*: a fresh one per iteration (and every :data:`ANCHOR_MAX_AGE_S` within one),
    recorded on an idle side stream (``stream("anchor")``, nothing else runs there), stamped with the
    host clock read just *before* its record call — a lower bound of its device time, tight on an idle
    stream — and raised to the time chained from its predecessor where that is later (an anchor
    processed late); ``elapsed_time`` is only ever called on completed events (CUDA refuses others)
    (:meth:`_EventTimer._settle_next`);
  - message arrival comes from the receive's completion (``Work.is_completed()``, truthful on NCCL:
    it queries the work's end event), polled by a watcher thread off the critical path — not from
    ``Work.wait()``, which on NCCL returns once the stream wait is enqueued (defect 2);
  - the consumer's stream wait (``Work.wait()`` on the compute stream) is placed just before the
    compute action that reads the data, as torch's ``_PipelineScheduleRuntime`` does (it pops the recv
    works from ``fwd_recv_ops``/``bwd_recv_ops`` right before ``forward_one_chunk``/``backward_one_chunk``);
    a wait placed when the receive is posted would stall the compute stream at the receive's position;
  - every CUDA call names the stage's device (``torch.cuda.device(dev)``), from any thread.

* ``titan_ext.testing.simdevice.SimDevice`` — an asynchronous-device simulation for CPU tests: receives
  that land later than their ``wait()`` returns, a compute stream that stalls where its waits sit, and
  events that report when the stream reached them.

The arrival stamp is a host-clock time on every implementation (the receiving host notices completion);
the sender's stamp is the time its data was ready on the device (an event on the compute stream on
CUDA), so ``arrival − send`` is the link's delay, not the enqueue gap of two hosts.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import queue
import threading
import time
from typing import Any, Callable

import torch

__all__ = ["ArrivalWatcher", "CpuDevice", "CudaDevice", "DeviceLayer", "RecvHandle", "Timer", "backend_waits_land",
           "device_layer", "device_sleep", "DeviceTimer", "now", "thread_device"]

#: bounds of the watcher's completion polling (seconds): a receive's arrival is stamped at most this
#: late after it landed, plus the thread's wake-up latency
POLL_MIN_S, POLL_MAX_S = 20e-6, 500e-6
#: a timing event is read from an anchor at most this old (host clock): float32 milliseconds of 60 s
#: are spaced 3.9 us apart, so the mapping's rounding stays far below the 0.1 ms the clock promises
ANCHOR_MAX_AGE_S = 60.0
#: the check chains from the previous anchor only over this span: float32 milliseconds of 10 s are
#: spaced 1 us apart, and a device clock that drifts 10 ppm from the host's is 100 us off after it
ANCHOR_CHAIN_MAX_S = 10.0


def now() -> float:
    """The runtime's host clock (seconds, monotonic, shared by the processes of one host)."""
    return time.perf_counter()


# --------------------------------------------------------------------------------------------------
# threads: the device a side thread must select before any device call
# --------------------------------------------------------------------------------------------------
def thread_device() -> Callable[[], Any]:
    """The calling thread's current device, as a context factory for a *side* thread.

    A CUDA call (an event query, ``Work.is_completed()`` on NCCL, a copy) from a thread that never
    selected a device runs on device 0: CUDA opens a primary context there (about 0.5 GiB) in every
    process whose GPU is not 0.  Call this on the thread that owns the device (the training thread,
    after TorchTitan's ``torch.cuda.set_device``) and enter ``factory()`` on the side thread around
    every device call, as ProcessGroupNCCL's watchdog takes a device guard before each query.  The
    guard also sets the thread-local CUDA-graph capture mode where the delegate extension can
    (:func:`_capture_mode_guard`), so a query from this thread never invalidates another thread's
    capture.  Returns ``contextlib.nullcontext`` where CUDA is not initialised (CPU jobs: no device to
    select, and no query may initialise one)."""
    sim = _SIMULATED.get("thread_device")
    if sim is not None:
        return sim()
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return contextlib.nullcontext
    index = torch.cuda.current_device()

    @contextlib.contextmanager
    def guard() -> Any:
        with torch.cuda.device(index), _capture_mode_guard():
            yield

    return guard


def _capture_mode_guard() -> Any:
    """The thread-local CUDA-graph capture mode (``cudaThreadExchangeStreamCaptureMode``) while a side
    thread queries, the previous mode restored after: no Python API sets it; the delegate extension
    binds it when built with CUDA (``capture_mode_exchange``, cpp_ext/capture_mode.cu), as
    ProcessGroupNCCL's watchdog takes ``CUDAStreamCaptureModeGuard{cudaStreamCaptureModeThreadLocal}``
    before its queries.  A no-op without it (a CPU build: nothing to capture)."""
    try:  # by name: the extension is a leaf, not the package (no import cycle through titan_ext)
        _delegate_C = importlib.import_module("titan_ext._delegate_C")
    except ImportError:
        return contextlib.nullcontext()
    exchange = getattr(_delegate_C, "capture_mode_exchange", None)
    if exchange is None:
        return contextlib.nullcontext()
    return _thread_local_capture(exchange, _delegate_C.CAPTURE_MODE_THREAD_LOCAL)


@contextlib.contextmanager
def _thread_local_capture(exchange: Callable[[int], int], thread_local: int) -> Any:
    previous = exchange(thread_local)
    try:
        yield
    finally:
        exchange(previous)


#: test-only replacements of the device entry points (``titan_ext.testing.lagdevice`` sets them):
#: ``"layer"`` (a CPU stage's device layer), ``"thread_device"``
_SIMULATED: dict[str, Callable[..., Any]] = {}


# --------------------------------------------------------------------------------------------------
# receives: arrival from completion (off the critical path), the wait placed before the consumer
# --------------------------------------------------------------------------------------------------
class Latch:
    """A one-shot flag any number of threads wait on and one thread sets: ``threading.Event``'s ``set`` /
    ``is_set`` / ``wait(timeout)`` on one raw lock (held until set), without the Condition an Event
    builds.  One is made per receive, on the main thread: construction, set and wait cost 0.4 µs of CPU
    against an Event's 3.7 µs (one thread, 100 000 of each, 2-core x86_64 VM)."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            self._lock.release()  # let every other waiter through
        return self._set


class RecvHandle:
    """A posted receive.  ``wait()`` is the consumer's wait and must be called just before the compute
    that reads the data (torch's ``_wait_batch_p2p`` calls it there).  ``arrival`` (host clock) is
    stamped by the :class:`ArrivalWatcher` when the data has landed.

    Two ways to know it landed (``host_wait``), one code path:

    * ``host_wait=True`` (gloo): ``Work.wait()`` returns once the data is in the buffer and
      ``is_completed()`` stays False until someone waited, so the watcher thread waits and stamps, and
      the consumer waits for the watcher;
    * ``host_wait=False`` (NCCL, the NCCL-rules test backend, the simulation): ``Work.wait()`` only makes
      the current stream wait, ``is_completed()`` is truthful; the watcher polls ``is_completed()`` and
      the consumer calls ``wait()`` on the main thread, so the stream wait sits just before the consumer.
    """

    def __init__(self, works: list[Any], device: "DeviceLayer | None" = None, host_wait: bool = True,
                 consumer_stamps: bool = False):
        self.works = list(works)
        self.host_wait = host_wait
        self.consumer_stamps = consumer_stamps and host_wait
        """No watcher: the consumer's own wait (gloo: returns once the data landed) stamps the arrival
        — exact when the consumer waited for the data, an upper bound when the data was there first
        (:meth:`DeviceLayer.watch`)."""
        self.arrival: float = math.nan
        self.error: BaseException | None = None
        self.done = Latch()
        self._device = device

    def wait(self, timeout: Any = None) -> bool:  # noqa: ARG002 - Work API compatibility
        if self.consumer_stamps and not self.done.is_set():
            try:
                for w in self.works:
                    w.wait()
                self.arrival = now()
            finally:
                self.done.set()
            return True
        if self.host_wait:
            self.done.wait()
            if self.error is not None:
                raise self.error
            return True
        with self._device.context() if self._device is not None else contextlib.nullcontext():
            for w in self.works:
                w.wait()
        if self._device is not None and not self._device.asynchronous:
            # the host is the device's stream (CPU): the stream wait is a host wait until landed
            self.done.wait()
            if self.error is not None:
                raise self.error
        return True

    def is_completed(self) -> bool:
        return self.done.is_set() and self.error is None

    def landed(self) -> bool:
        """Whether the data is in the buffers (``host_wait``: blocks until it is)."""
        if self.host_wait:
            for w in self.works:
                w.wait()
            return True
        return all(_completed(w) for w in self.works)

    def arrival_time(self, timeout_s: float = 60.0) -> float:
        """The arrival stamp, waiting for the watcher if it has not stamped yet (call it after the
        receive's consumer ran, e.g. at the iteration boundary; NaN if it never landed in time)."""
        self.done.wait(timeout_s)
        return self.arrival


def _completed(work: Any) -> bool:
    fn = getattr(work, "is_completed", None)
    if fn is None:
        raise TypeError(f"{type(work).__name__} has no is_completed(): its arrival cannot be observed")
    return bool(fn())


def backend_waits_land(backend: str) -> bool:
    """Whether a process-group backend's ``Work.wait()`` returns only once a receive's data has landed
    (gloo) — every other backend is treated as NCCL (stream-wait semantics, truthful completion)."""
    return str(backend).lower() == "gloo"


class ArrivalWatcher:
    """One daemon thread per peer: stamps its receives' arrival in posting (= FIFO) order — by polling
    ``Work.is_completed()`` (exponential back-off between ``POLL_MIN_S`` and ``POLL_MAX_S``), or, for a
    ``host_wait`` handle (gloo), by waiting.  It never calls an NCCL work's ``wait()``: that would
    enqueue a stream wait at the receive's position, not its consumer's."""

    def __init__(self, context: Callable[[], Any] = contextlib.nullcontext):
        self._queues: dict[int, queue.SimpleQueue] = {}
        self._context = context

    def watch(self, peer: int, handle: RecvHandle) -> RecvHandle:
        q = self._queues.get(peer)
        if q is None:
            q = self._queues[peer] = queue.SimpleQueue()
            threading.Thread(target=self._run, args=(q,), name=f"titan_ext-arrival-{peer}", daemon=True).start()
        q.put(handle)
        return handle

    def _run(self, q: queue.SimpleQueue) -> None:
        with self._context():
            while True:
                handle = q.get()
                if handle is None:
                    return
                try:
                    pause = POLL_MIN_S
                    while not handle.landed():
                        time.sleep(pause)
                        pause = min(2 * pause, POLL_MAX_S)
                    handle.arrival = now()
                except BaseException as exc:  # noqa: BLE001 - surfaced by the consumer's wait()
                    handle.error = exc
                handle.done.set()

    def close(self) -> None:
        for q in self._queues.values():
            q.put(None)
        self._queues.clear()


# --------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------
class Timer:
    """Times one rank's iteration: ``begin_iteration``, ``start``/``stop`` around each compute action,
    ``mark`` for send stamps, ``end_iteration``; then ``resolve`` fills host-clock times.

    Host-clock implementation (CPU, and the base of the others): stamps are taken at once and
    ``resolve`` has nothing to do.  ``wall_ms`` is the iteration's span from ``begin_iteration`` to
    ``end_iteration`` *as the device ran it* (NaN until resolved)."""

    def __init__(self) -> None:
        self.wall_ms = math.nan
        self._begin = math.nan

    def discard(self) -> None:
        """Drop the unresolved times of the previous iteration (host clock: nothing is pending)."""

    def begin_iteration(self) -> None:
        self.wall_ms = math.nan
        self._begin = now()

    def start(self, rec: Any) -> Any:
        rec.start = now()
        return None

    def stop(self, rec: Any, token: Any) -> None:  # noqa: ARG002
        rec.end = now()

    def mark(self, stamps: list[float]) -> None:
        """Append this point of the compute stream's time to ``stamps`` (a send's hand-over)."""
        stamps.append(now())

    def recv_wait_begin(self) -> Any:
        """Before a consumer's wait: a token for :meth:`recv_wait_ms`."""
        return now()

    def recv_wait_ms(self, rec: Any, token: Any) -> None:
        """After the wait and ``start(rec)``: how long the stream stalled on the input (ms)."""
        rec.recv_wait_ms = 1e3 * max(rec.start - token, 0.0) if not math.isnan(rec.start) else 1e3 * (now() - token)

    def end_iteration(self) -> None:
        self.wall_ms = 1e3 * (now() - self._begin)

    def resolve(self, block: bool = True) -> bool:  # noqa: ARG002
        """Fill the iteration's times; without ``block`` only if the device finished (returns whether)."""
        return True

    def mark_ready(self) -> Any:
        """A token for the time data produced so far is ready on the device (host clock: now)."""
        return now()

    def ready_time(self, token: Any) -> float:
        """The host time of a :meth:`mark_ready` token."""
        return token


class _Anchor:
    """An event with a known host time (:class:`_EventTimer`'s clock mapping): ``host`` is a *lower
    bound* of when the device processed it, never later than the truth (see :meth:`_EventTimer._settle_next`)."""

    __slots__ = ("ev", "host", "settled")

    def __init__(self, ev: Any, host: float, settled: bool):
        self.ev, self.host, self.settled = ev, host, settled


class _Iteration:
    """One iteration's timing events, until the device has run them and they are resolved."""

    __slots__ = ("pending", "begin", "end")

    def __init__(self, begin: Any):
        self.pending: list[tuple[Any, Any, Any, _Anchor]] = []  # (target, field-or-index, event, anchor)
        self.begin, self.end = begin, None


class _EventTimer(Timer):
    """Event-based timer of an asynchronous device (CUDA; the simulations reuse it).

    ``event()`` makes a timing event recorded on the compute stream.  Times are mapped onto the host
    clock through the most recent anchor recorded before the event (:meth:`_anchor`), so a mapping
    spans at most an iteration or :data:`ANCHOR_MAX_AGE_S`, whatever the job's age.

    **No host sync in a steady iteration.**  An iteration the device has not finished when the next one
    begins (the host ran ahead: the normal case on a GPU) is kept in a backlog and resolved by a later
    non-blocking :meth:`resolve` once its last event completed; only ``resolve(block=True)`` (the
    profile-exchange boundary, a logging step) waits, on the newest iteration's last event — never a
    device ``synchronize``.  The backlog holds at most :attr:`BACKLOG` iterations (the oldest are
    dropped: a device that many iterations behind is not a steady state)."""

    BACKLOG = 8

    def __init__(self, device: "DeviceLayer"):
        super().__init__()
        self.device = device
        self._it: _Iteration | None = None  # the current (newest) iteration
        self._backlog: list[_Iteration] = []  # earlier iterations not resolved yet, oldest first
        self._anchor_now: _Anchor | None = None  # the anchor of events recorded now
        self._settled: _Anchor | None = None  # the latest anchor whose host time is final
        self._unsettled: list[_Anchor] = []  # later anchors, in recording order
        self._lock = threading.RLock()  # anchors are settled from helper threads too (ready_time)
        self.blocking_resolves = 0  # how many resolves had to wait for the device (tests, metrics)

    @property
    def _pending(self) -> list:
        """The current iteration's unresolved timing events (tests)."""
        return self._it.pending if self._it is not None else []

    def _record(self) -> Any:
        ev = self.device.event()
        with self.device.context():
            ev.record(self.device.compute_stream())
        return ev

    def _anchor(self) -> None:
        """A fresh anchor for the events recorded from now on (:meth:`_new_anchor`)."""
        with self._lock:
            self._new_anchor()

    def _new_anchor(self) -> None:
        """An anchor on the idle anchor stream, stamped with the host clock read right *before* the
        record call: the device cannot process an event before it is recorded, so the stamp is a lower
        bound of the event's device time, exact to the record call's duration plus the device's latency
        on an idle stream (microseconds) — whatever delays the host thread after the call (GC,
        preemption, the GIL).  No wait, not even for the first one."""
        ev = self.device.event()
        with self.device.context():
            while self._unsettled and self._unsettled[0].ev.query():  # settle what completed, in order
                self._settle_next()
            host = now()
            ev.record(self.device.stream("anchor"))
        anchor = _Anchor(ev, host, settled=self._settled is None)
        if anchor.settled:
            self._settled = anchor
        else:
            self._unsettled.append(anchor)
        self._anchor_now = anchor

    def _settle(self, anchor: _Anchor, block: bool) -> bool:
        """Make ``anchor``'s host time final, settling the earlier ones first (:meth:`_settle_next`).
        Only a *completed* anchor is settled (``elapsed_time`` refuses an incomplete event): without
        ``block`` returns False if one is not; with it, waits for it by polling ``query()`` (an anchor
        on the idle anchor stream completes microseconds after its record)."""
        while not anchor.settled:
            head = self._unsettled[0]
            pause = POLL_MIN_S
            while not head.ev.query():
                if not block:
                    return False
                time.sleep(pause)
                pause = min(2 * pause, POLL_MAX_S)
            self._settle_next()
        return True

    def _settle_next(self) -> None:
        """Settle the oldest unsettled anchor (its event completed).  Its stamp and the time chained
        from the previous anchor through ``elapsed_time`` are both lower bounds of its device time (a
        settled anchor's time is one, and the device clock measures the span between the two); the
        later of them is the tighter bound — a late-processed anchor (its stream shared a hardware queue
        with a busy one) takes the chained time.  Since neither can exceed the truth, an error never
        ratchets upwards, as ``max(stamp, chained)`` over stamps read *after* the record call did: a
        stamp delayed by GC or preemption became every later anchor's time.  Chained only over
        :data:`ANCHOR_CHAIN_MAX_S`, where float32 milliseconds and the drift between the device's
        and the host's clocks stay at microseconds."""
        anchor, prev = self._unsettled.pop(0), self._settled
        if anchor.host - prev.host <= ANCHOR_CHAIN_MAX_S:
            anchor.host = max(anchor.host, prev.host + prev.ev.elapsed_time(anchor.ev) / 1e3)
        anchor.settled = True
        self._settled = anchor

    def discard(self) -> None:
        """Drop the unresolved times of the previous iterations (nobody needs them)."""
        self._it, self._backlog = None, []

    def begin_iteration(self) -> None:
        if self._it is not None and self._it.pending:  # not read at its boundary: resolved later, no wait
            self._backlog.append(self._it)
            del self._backlog[:-self.BACKLOG]
            self._resolve_backlog()
        self.wall_ms = math.nan
        self._anchor()
        self._it = _Iteration(self._record())

    def _timed(self, target: Any, key: Any, ev: Any = None) -> Any:
        """Record (or take) a timing event for ``target[key]``, read later from the current anchor
        (a fresh one first if it is older than :data:`ANCHOR_MAX_AGE_S`)."""
        if now() - self._anchor_now.host > ANCHOR_MAX_AGE_S:
            self._anchor()
        ev = self._record() if ev is None else ev
        self._it.pending.append((target, key, ev, self._anchor_now))
        return ev

    def start(self, rec: Any) -> Any:
        return self._timed(rec, "start")

    def stop(self, rec: Any, token: Any) -> None:  # noqa: ARG002
        self._timed(rec, "end")

    def mark(self, stamps: list[float]) -> None:
        stamps.append(math.nan)
        self._timed(stamps, len(stamps) - 1)

    def recv_wait_begin(self) -> Any:
        return self._record()

    def recv_wait_ms(self, rec: Any, token: Any) -> None:
        self._timed(rec, "recv_wait_from", token)

    def end_iteration(self) -> None:
        self._it.end = self._record()

    def host_time(self, ev: Any, anchor: _Anchor | None = None) -> float:
        """The host-clock time of a completed event recorded after ``anchor`` (default: the current
        one), through a short ``elapsed_time`` (waits for the anchor itself if it has not completed)."""
        anchor = self._anchor_now if anchor is None else anchor
        with self._lock:
            self._settle(anchor, block=True)
        return anchor.host + anchor.ev.elapsed_time(ev) / 1e3

    def mark_ready(self) -> tuple[Any, "_Anchor"]:
        """An event on the compute stream now (data produced so far is ready when it completes),
        with its anchor: a token for :meth:`ready_time`."""
        with self._lock:
            if self._anchor_now is None or now() - self._anchor_now.host > ANCHOR_MAX_AGE_S:
                self._new_anchor()
            return self._record(), self._anchor_now

    def ready_time(self, token: tuple[Any, "_Anchor"], poll_s: float = POLL_MIN_S) -> float:
        """The host time of a :meth:`mark_ready` event, polling ``query()`` until it (and its anchor)
        completed — call it from a helper thread under :func:`thread_device`'s guard, never the
        schedule's (it waits for the device)."""
        ev, anchor = token
        pause = poll_s
        with self.device.context():
            while not ev.query():
                time.sleep(pause)
                pause = min(2 * pause, POLL_MAX_S)
            return self.host_time(ev, anchor)

    def _resolve_one(self, it: _Iteration, block: bool) -> bool:
        """Fill ``it``'s times if its last event completed (with ``block``: after waiting for it)."""
        if not it.end.query():
            if not block:
                return False
            self.blocking_resolves += 1
            it.end.synchronize()  # this iteration's last event only, never the device
        with self._lock:
            if not all(self._settle(a, block) for a in {id(p[3]): p[3] for p in it.pending}.values()):
                return False
        for target, key, ev, anchor in it.pending:
            t = anchor.host + anchor.ev.elapsed_time(ev) / 1e3
            if key == "recv_wait_from":
                target.recv_wait_ms = 1e3 * max(target.start - t, 0.0)
            elif isinstance(key, str):
                setattr(target, key, t)
            else:
                target[key] = t
        it.pending = []
        return True

    def _resolve_backlog(self) -> None:
        """Resolve the earlier iterations the device has finished, oldest first (no wait)."""
        with self.device.context():
            while self._backlog and self._resolve_one(self._backlog[0], block=False):
                self._backlog.pop(0)

    def resolve(self, block: bool = True) -> bool:
        """Fill the times of the backlog and of the current iteration; without ``block`` only what the
        device has finished (returns whether the current iteration is resolved)."""
        it = self._it
        if it is None or it.end is None:
            self._resolve_backlog()
            return it is None or not it.pending
        with self.device.context():
            if block:  # the newest iteration's last event: every earlier one's completed before it
                if not it.end.query():
                    self.blocking_resolves += 1
                    it.end.synchronize()
                for old in self._backlog:
                    self._resolve_one(old, block=True)
                self._backlog = []
            else:
                self._resolve_backlog()
            if not self._resolve_one(it, block):
                return False
            self.wall_ms = it.begin.elapsed_time(it.end)
        self._it = None
        return True


# --------------------------------------------------------------------------------------------------
# the device layer
# --------------------------------------------------------------------------------------------------
class DeviceLayer:
    """The stage's device: timing, arrival, waits, buffers, streams (one object per executor)."""

    #: ``Work.wait()`` of a receive returns once its data landed (gloo); see :func:`backend_waits_land`
    wait_lands = True
    #: kernels run later than the host enqueues them: time with events, never with the host clock
    asynchronous = False

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.watcher = ArrivalWatcher(self.context)
        self._ready_clock: Timer | None = None

    def set_backend(self, backend: str) -> None:
        """The PP data group's backend decides how a receive's landing is observed (:class:`RecvHandle`)."""
        self.wait_lands = backend_waits_land(backend)

    # -- devices and streams ----------------------------------------------------------------------
    def context(self) -> Any:
        """A context that makes every CUDA call in it name this stage's device (any thread)."""
        return contextlib.nullcontext()

    def compute_stream(self) -> Any:
        return None

    def stream(self, name: str) -> Any:  # noqa: ARG002
        """A named side stream (e.g. ``"d2h"``, ``"h2d"``): one per name and device; None on CPU."""
        return None

    def event(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no device events")

    # -- buffers ----------------------------------------------------------------------------------
    def empty(self, shape: Any, dtype: torch.dtype, *, pinned_host: bool = False) -> torch.Tensor:
        """A buffer on this device, or a host buffer (pinned where the device copies from it)."""
        if pinned_host:
            return torch.empty(shape, dtype=dtype, pin_memory=self.device.type == "cuda")
        return torch.empty(shape, dtype=dtype, device=self.device)

    def memory_free_bytes(self) -> float:
        """Free device memory now, plus what the caching allocator holds unused (NaN: no limit known)."""
        return math.nan

    # -- timing and receives ----------------------------------------------------------------------
    def timer(self) -> Timer:
        return Timer()

    def mark_ready(self) -> Any:
        """Data produced so far on the compute stream is ready when this mark is reached: a token
        for :meth:`ready_time` (an event on the compute stream; the host clock on CPU).  Used for
        a send's hand-over time, e.g. by delay injection's stamps."""
        if self._ready_clock is None:
            self._ready_clock = self.timer()
        return self._ready_clock.mark_ready()

    def ready_time(self, token: Any) -> float:
        """The host-clock time of a :meth:`mark_ready` token, waiting (on CUDA by polling the
        event's ``query()``, no sync) until the device reached it: call it off the critical path."""
        return self._ready_clock.ready_time(token)

    def watch(self, peer: int, works: list[Any], exact: bool = True) -> RecvHandle:
        """A posted receive's handle; its arrival is stamped off the critical path by the watcher.
        ``exact=False`` where a wait lands the data (gloo): no watcher, the consumer's wait stamps it
        (:attr:`RecvHandle.consumer_stamps`) — no thread hop between the data and its consumer, and a
        stamp that is late only by however long the data waited for its consumer.  Where waits do not
        land the data (NCCL) the watcher is never on the critical path and always stamps."""
        handle = RecvHandle(works, self, host_wait=self.wait_lands, consumer_stamps=not exact)
        return handle if handle.consumer_stamps else self.watcher.watch(peer, handle)

    def wait_recv(self, handles: list[Any]) -> None:
        """The consumer's wait, placed just before the compute that reads the data."""
        for h in handles:
            h.wait()

    def close(self) -> None:
        self.watcher.close()


class CpuDevice(DeviceLayer):
    """Today's behaviour on CPU: host clock, host waits (gloo's ``wait()`` returns once data landed)."""


class CudaDevice(DeviceLayer):
    """CUDA: events on the compute stream, stream waits, every call under ``torch.cuda.device(dev)``."""

    wait_lands = False
    asynchronous = True

    def __init__(self, device: torch.device):
        if torch.device(device).type != "cuda":
            raise ValueError(f"CudaDevice needs a cuda device, got {device}")
        if torch.device(device).index is None:
            raise ValueError(f"CudaDevice needs an indexed cuda device (cuda:N) for calls from any thread, got {device}")
        super().__init__(device)
        self._streams: dict[str, Any] = {}

    def context(self) -> Any:
        return torch.cuda.device(self.device)

    def compute_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def stream(self, name: str) -> Any:
        if name not in self._streams:
            with self.context():
                self._streams[name] = torch.cuda.Stream(self.device)
        return self._streams[name]

    def event(self) -> Any:
        return torch.cuda.Event(enable_timing=True)

    def memory_free_bytes(self) -> float:
        with self.context():
            free, _ = torch.cuda.mem_get_info(self.device)
            cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return float(free + max(cached, 0))

    def timer(self) -> Timer:
        return _EventTimer(self)


def device_layer(device: torch.device | str) -> DeviceLayer:
    """The layer for a stage's device: CUDA (needs ``cuda:N`` and an available GPU) or CPU (or, in a
    test that installed one, the simulated device that runs behind the host: ``testing/lagdevice.py``)."""
    dev = torch.device(device)
    if dev.type == "cpu" and "layer" in _SIMULATED:
        return _SIMULATED["layer"](dev)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"stage device {dev} but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return CudaDevice(dev)
    return CpuDevice(dev)


# --------------------------------------------------------------------------------------------------
# a completion timer and a device-side delay for Falcon's start-up costs, validation and emulation
# --------------------------------------------------------------------------------------------------
class DeviceTimer:
    """Completion times of device work on ``device``'s current stream."""

    def __init__(self, device):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            with torch.cuda.device(self.device):
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
            return ev
        return time.perf_counter()

    def elapsed_s(self, start: Any, end: Any, wait: bool = True) -> float | None:
        """Seconds from mark ``start`` to mark ``end``; on CUDA waits for ``end`` (or, with
        ``wait=False``, returns None while it is still pending: no host sync)."""
        if not self.cuda:
            return end - start
        with torch.cuda.device(self.device):
            if not end.query():
                if not wait:
                    return None
                end.synchronize()  # start-up and validation only (blocking by design)
            return start.elapsed_time(end) / 1e3


    def completion_s(self, start: Any, works: list) -> float:
        """Seconds from mark ``start`` until the communication ``works`` have *landed*: on CUDA an
        event recorded after ``wait()`` (which makes the stream wait) read once it completes; on
        CPU polling ``is_completed()`` after ``wait()`` (NCCL's ``wait()`` — and the nccl_rules
        test backend's — returns before the data has landed)."""
        for work in works:
            work.wait()
        if self.cuda:
            return self.elapsed_s(start, self.mark())
        while not all(work.is_completed() for work in works):
            time.sleep(0)
        return time.perf_counter() - start


_CYCLES_PER_S: dict[int, float] = {}


def _cycles_per_second(device: torch.device) -> float:
    """Calibrate ``torch.cuda._sleep`` (GPU clock cycles) against CUDA events, once per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CYCLES_PER_S:
        timer, cycles = DeviceTimer(device), 10_000_000
        with torch.cuda.device(device):
            start = timer.mark()
            torch.cuda._sleep(cycles)
            end = timer.mark()
        _CYCLES_PER_S[index] = cycles / max(timer.elapsed_s(start, end), 1e-6)
    return _CYCLES_PER_S[index]


def device_sleep(seconds: float, device=None) -> None:
    """Delay ``device``'s current stream by ``seconds``, the device held meanwhile: on CUDA a spin
    kernel (``torch.cuda._sleep``), on CPU a busy wait of the host. (A CPU rank that *slept* would
    lend its core to the other ranks time-sharing the host: with 4 ranks on 2 cores most of the
    delay then disappears from the iteration time — measured: a +150 ms sleep before stage 0's
    DP all-reduce left the median step unchanged within the noise; a device with a slow link is not
    lent to another one.)"""
    if seconds <= 0:
        return
    if device is not None and torch.device(device).type == "cuda":
        device = torch.device(device)
        with torch.cuda.device(device):
            torch.cuda._sleep(int(seconds * _cycles_per_second(device)))
    else:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
