"""A simulated device that runs *behind* the host, for CPU tests.

On a GPU the host enqueues kernels, copies, stream waits and event records, and the device executes
them later: the host runs ahead.  A call that waits for the device (``synchronize``, ``Event.synchronize``,
a read of a device tensor) drains that lead, and a device call from a thread that never selected its
device opens a CUDA context on GPU 0.  A CPU test whose "device" is the host itself sees neither.  Here:

* **a device thread per process** executes what the host enqueued on its streams, each item no earlier
  than ``lag`` after the host enqueued it (:data:`LAG_ENV`, default :data:`DEFAULT_LAG_MS`): *event
  records* (an event completes when the device reaches it, its time is the host clock then), *stream
  waits* on a communication op (the stream stalls until the op's data landed: ``nccl_rules``'
  ``Work.wait()`` calls :func:`stream_wait`) and on an event (``Stream.wait_event``), and *kernels*:
  with :data:`KERNELS_ENV` ``=1`` every aten op the training thread runs is one, lasting as long as
  the host took to compute it (coalesced into one item per :data:`COALESCE_S`; exact but slow: a
  Python dispatch mode on every op), else only the kernels a test enqueues (:meth:`LagDevice.kernel`)
  — the device then runs the host's work at the host's pace, ``lag`` later, and catches up at once
  after a stall.  The lag is the compute stream's backlog: streams run concurrently, and a named side
  stream (the anchor stream of the device layer's timer, a copy stream) has none — its work runs as
  soon as what it waits for is done, so an event recorded on an idle one completes at once;
* **host-blocking calls block**: ``Event.synchronize`` waits until the device reached the event, and a
  read of a device tensor on the training thread (``.item()``, ``.tolist()``, ``.cpu()``, ``float()``,
  a blocking copy: :mod:`titan_ext.testing.host_syncs`' classification) waits until the compute stream
  ran everything enqueued so far; each is counted by call site through ``host_syncs.record`` (the reads
  are counted by ``host_syncs.counting`` itself);
* **a current device per thread**: the installing thread's is its rank's (TorchTitan's
  ``torch.cuda.set_device(local_rank)``), every other thread starts with *none selected*; a device call
  (an event record, query, synchronize or ``elapsed_time``, ``Work.wait``/``is_completed`` on the
  NCCL-like backend: :func:`device_call`) from a thread whose current device is not the rank's is a
  :attr:`LagDevice.violations` entry naming the call site — on a GPU it would open a context on GPU 0
  (rank 0 included: a side thread of rank 0 that never selected its device is reported too, the
  stricter rule);
* ``elapsed_time`` refuses an incomplete event (``cudaErrorNotReady``) and returns float32 milliseconds
  (``cudaEventElapsedTime`` returns a C ``float``).

The runtime reaches the device through its device layer: :func:`install` makes
:func:`titan_ext.runtime.execute.device.device_layer` return a :class:`LagLayer` for a CPU stage (events,
streams, the device guard) and :func:`titan_ext.runtime.execute.device.thread_device` capture the simulated
current device.  The data itself is still computed by the host, in program order (an op that reads a
received buffer waits on the host for the data: ``nccl_rules``' rule, not a host sync).

:func:`install_accounting` (the TorchTitan CPU shim calls it under ``TITAN_EXT_TEST_DEVICE=lag``) writes one
JSON line per optimizer step to ``$TITAN_EXT_LAG_REPORT/rank<r>.jsonl``: the host-blocking calls of the
step by call site, whether the device was still behind the host at the step's end, and the violations.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titan_ext.runtime.comm.delegate import _device as delegate_device
from titan_ext.runtime.execute import device as device_mod
from titan_ext.testing import host_syncs
from titan_ext.runtime.execute.device import DeviceLayer, Timer, _EventTimer, now

__all__ = ["DEFAULT_LAG_MS", "ENV_VAR", "KERNELS_ENV", "LAG_ENV", "REPORT_ENV", "LagDevice", "LagEvent", "LagLayer", "LagStream",
           "device", "device_call", "host_block", "install", "install_accounting", "install_from_env", "installed",
           "stream_wait", "uninstall"]

ENV_VAR = "TITAN_EXT_TEST_DEVICE"  #: ``lag``: the CPU shim installs this device
LAG_ENV = "TITAN_EXT_LAG_MS"
KERNELS_ENV = "TITAN_EXT_LAG_KERNELS"
REPORT_ENV = "TITAN_EXT_LAG_REPORT"
DEFAULT_LAG_MS = 20.0
COALESCE_S = 1e-3  # consecutive aten ops are one kernel item until this much host time accumulated
_POLL_S = 2e-4  # the device thread's poll of a stream wait's predicate

_EVENT, _KERNEL, _WAIT, _WAIT_EVENT = range(4)


class _Item:
    __slots__ = ("kind", "enq", "dur", "event", "landed", "name", "seq")

    def __init__(self, kind: int, enq: float, dur: float = 0.0, event: "LagEvent | None" = None,
                 landed: Callable[[], bool] | None = None, name: str = ""):
        self.kind, self.enq, self.dur, self.event, self.landed, self.name = kind, enq, dur, event, landed, name
        self.seq = 0


class LagStream:
    """One stream of the simulated device: a FIFO the device thread executes in order."""

    def __init__(self, dev: "LagDevice", name: str):
        self.dev, self.name = dev, name
        self.items: collections.deque[_Item] = collections.deque()
        self.free = 0.0  # host-clock time until which the stream is busy with a kernel
        self.enqueued = 0
        self.executed = 0

    def wait_event(self, event: "LagEvent") -> None:
        """``Stream.wait_event``: later work of this stream waits until ``event`` completed."""
        self.dev.device_call("Stream.wait_event")
        if event.recorded:
            self.dev.enqueue(self, _Item(_WAIT_EVENT, now(), event=event, name="wait_event"))

    def synchronize(self) -> None:
        self.dev.device_call("Stream.synchronize")
        self.dev.host_block("Stream.synchronize", self)

    def query(self) -> bool:
        self.dev.device_call("Stream.query")
        return self.executed >= self.enqueued

    def __repr__(self) -> str:
        return f"LagStream({self.name})"


class LagEvent:
    """``torch.cuda.Event(enable_timing=True)`` of the simulated device."""

    def __init__(self, dev: "LagDevice"):
        self.dev = dev
        self.t: float | None = None
        self.recorded = False

    def record(self, stream: LagStream | None = None) -> None:
        self.dev.device_call("Event.record")
        stream = stream if stream is not None else self.dev.current_stream()
        self.t, self.recorded = None, True
        self.dev.enqueue(stream, _Item(_EVENT, now(), event=self))

    def query(self) -> bool:
        self.dev.device_call("Event.query")
        return not self.recorded or self.t is not None  # CUDA: an unrecorded event is complete

    def synchronize(self) -> None:
        self.dev.device_call("Event.synchronize")
        if self.recorded and self.t is None:
            self.dev.host_block("Event.synchronize", until=lambda: self.t is not None)
        else:
            host_syncs.record("Event.synchronize")

    def elapsed_time(self, end: "LagEvent") -> float:
        self.dev.device_call("Event.elapsed_time")
        if self.t is None or end.t is None:
            raise RuntimeError("CUDA error: device not ready (elapsed_time of an event that has not completed)")
        return float(np.float32(1e3 * (end.t - self.t)))  # cudaEventElapsedTime: a C float


class LagDevice:
    """The simulated device of one process (module docstring)."""

    def __init__(self, index: int, lag_s: float):
        if lag_s < 0:
            raise ValueError(f"LagDevice: negative lag {lag_s}")
        self.index, self.lag_s = index, lag_s
        self._cv = threading.Condition()
        self._tls = threading.local()
        self.compute = LagStream(self, "compute")
        self._streams: dict[str, LagStream] = {"compute": self.compute}
        self.violations: list[str] = []
        self._kernel_s = 0.0  # host compute not yet enqueued as a kernel item
        self._stopped = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"titan_ext-lagdevice-{index}")
        self._thread.start()

    # -- threads and streams ------------------------------------------------------------------
    def current_index(self) -> int | None:
        return getattr(self._tls, "index", None)

    def select(self, index: int | None) -> None:
        """``torch.cuda.set_device`` on the calling thread."""
        self._tls.index = index

    @contextlib.contextmanager
    def guard(self, index: int | None = None) -> Any:
        """``torch.cuda.device(index)`` (default: this process's device) on the calling thread."""
        prev = self.current_index()
        self._tls.index = self.index if index is None else index
        try:
            yield
        finally:
            self._tls.index = prev

    def current_stream(self) -> LagStream:
        return getattr(self._tls, "stream", None) or self.compute

    def stream(self, name: str) -> LagStream:
        with self._cv:
            if name not in self._streams:
                self._streams[name] = LagStream(self, name)
            return self._streams[name]

    def device_call(self, what: str) -> None:
        """A device call from this thread: a violation unless the thread selected this process's device."""
        index = self.current_index()
        if index != self.index:
            selected = "no device selected" if index is None else f"device {index} selected"
            self.violations.append(f"{what} at {host_syncs._site()} in thread "
                                   f"{threading.current_thread().name} ({selected}; this rank's device is "
                                   f"{self.index}): on a GPU it opens a context on GPU {index or 0}")

    # -- the host side: enqueue, block ---------------------------------------------------------
    def enqueue(self, stream: LagStream, item: _Item) -> None:
        with self._cv:
            if stream is self.compute:
                self._flush_kernel_locked()
            self._push_locked(stream, item)

    def _push_locked(self, stream: LagStream, item: _Item) -> None:
        stream.enqueued += 1
        item.seq = stream.enqueued
        stream.items.append(item)
        self._cv.notify_all()

    def kernel(self, ms: float) -> None:
        """A kernel of ``ms`` on the compute stream (device-bound work a test enqueues)."""
        with self._cv:
            self._flush_kernel_locked()
            self._push_locked(self.compute, _Item(_KERNEL, now(), dur=ms / 1e3, name="kernel"))

    def add_kernel_time(self, seconds: float) -> None:
        """Host compute of the training thread: a kernel of the compute stream (coalesced)."""
        self._kernel_s += seconds
        if self._kernel_s >= COALESCE_S:
            with self._cv:
                self._flush_kernel_locked()

    def _flush_kernel_locked(self) -> None:
        if self._kernel_s > 0:
            self._push_locked(self.compute, _Item(_KERNEL, now(), dur=self._kernel_s, name="kernel"))
            self._kernel_s = 0.0

    def host_block(self, kind: str, stream: LagStream | None = None,
                   until: Callable[[], bool] | None = None) -> None:
        """The host waits for the device (``until()``, or everything enqueued on ``stream`` so far —
        default the compute stream); counted by call site (``host_syncs``)."""
        host_syncs.record(kind)
        self.drain(stream, until)

    def drain(self, stream: LagStream | None = None, until: Callable[[], bool] | None = None) -> None:
        """Wait until ``until()``, or until ``stream`` (default: the compute stream) ran what it holds now."""
        stream = stream if stream is not None else self.compute
        with self._cv:
            if stream is self.compute:
                self._flush_kernel_locked()
            target = stream.enqueued
            done = until if until is not None else (lambda: stream.executed >= target)
            while not done():
                if self.error is not None:
                    raise RuntimeError("the simulated device failed") from self.error
                self._cv.wait(0.05)

    def behind(self) -> bool:
        """Whether the compute stream still has work the host enqueued (the host is ahead)."""
        with self._cv:
            return self.compute.executed < self.compute.enqueued or self._kernel_s > 0

    # -- the device thread ---------------------------------------------------------------------
    def _ready_at(self, stream: LagStream, item: _Item) -> float | None:
        """When ``item`` (its stream's head) can execute; None: it waits on something not yet done."""
        at = max(item.enq + (self.lag_s if stream is self.compute else 0.0), stream.free)
        if item.kind == _WAIT and not item.landed():
            return None
        if item.kind == _WAIT_EVENT and item.event.t is None:
            return None
        return at

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    if self._stopped:
                        return
                    t, progressed, wake = now(), False, 0.05
                    for stream in list(self._streams.values()):
                        while stream.items:
                            item = stream.items[0]
                            at = self._ready_at(stream, item)
                            if at is None:
                                wake = min(wake, _POLL_S)
                                break
                            if at > t:
                                wake = min(wake, at - t)
                                break
                            stream.items.popleft()
                            # device times are the items' own (a device thread that woke late is
                            # the simulation's delay, not the device's); a wait ends when it was seen
                            if item.kind == _KERNEL:
                                stream.free = at + item.dur
                            elif item.kind == _EVENT:
                                item.event.t = stream.free = at
                            else:
                                stream.free = max(at, t) if item.kind == _WAIT else max(at, item.event.t)
                            stream.executed += 1
                            progressed = True
                    if progressed:
                        self._cv.notify_all()
                    else:
                        self._cv.wait(max(wake, 1e-5))
        except BaseException as exc:  # noqa: BLE001 - surfaced by host_block
            self.error = exc
            with self._cv:
                self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()


class _Kernels(TorchDispatchMode):
    """On the training thread: every aten op is device work (its host time, as a kernel)."""

    def __init__(self, dev: LagDevice):
        super().__init__()
        self.dev = dev

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.dev.add_kernel_time(time.perf_counter() - t0)
        return out


class _HostReads(torch.overrides.TorchFunctionMode):
    """On the training thread: a read of a device tensor waits for the compute stream (it is counted
    by ``host_syncs.counting`` where one is open)."""

    def __init__(self, dev: LagDevice):
        super().__init__()
        self.dev = dev

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if host_syncs._Counting._kind(func, args, kwargs) is not None:
            self.dev.drain()
        return func(*args, **kwargs)


class LagLayer(DeviceLayer):
    """The device layer on the simulated device: its events, streams and guard; NCCL's semantics for
    receives on the NCCL-like backend (``set_backend`` as on CUDA), gloo's host waits otherwise."""

    asynchronous = True

    def __init__(self, device: torch.device, sim: LagDevice):
        super().__init__(device)
        self.sim = sim

    def context(self) -> Any:
        return self.sim.guard()

    def compute_stream(self) -> Any:
        return self.sim.current_stream()

    def stream(self, name: str) -> Any:
        return self.sim.stream(name)

    def event(self) -> Any:
        return LagEvent(self.sim)

    def timer(self) -> Timer:
        return _EventTimer(self)


_DEVICE: LagDevice | None = None
_MODES: list[Any] = []


def installed() -> bool:
    return _DEVICE is not None


def device() -> LagDevice:
    if _DEVICE is None:
        raise RuntimeError("no simulated device installed (titan_ext.testing.lagdevice.install)")
    return _DEVICE


def device_call(what: str) -> None:
    """A device call from the calling thread (no-op when no simulated device is installed)."""
    if _DEVICE is not None:
        _DEVICE.device_call(what)


def stream_wait(landed: Callable[[], bool], name: str = "") -> None:
    """Enqueue a wait on the calling thread's current stream until ``landed()`` (no-op when not installed)."""
    if _DEVICE is not None:
        _DEVICE.enqueue(_DEVICE.current_stream(), _Item(_WAIT, now(), landed=landed, name=name))


def host_block(kind: str) -> None:
    """The host waits until the device ran everything enqueued so far (no-op when not installed)."""
    if _DEVICE is not None:
        _DEVICE.host_block(kind)


def _rank_index() -> int:
    for var in ("LOCAL_RANK", "RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def install(lag_ms: float | None = None, index: int | None = None, kernels: bool | None = None) -> LagDevice:
    """Install the simulated device in this process (idempotent); the calling thread is the training
    thread: its current device is the rank's, its reads of device tensors block, and with ``kernels``
    (default ``$TITAN_EXT_LAG_KERNELS``) its ops are kernels."""
    global _DEVICE
    if _DEVICE is not None:
        return _DEVICE
    lag = float(os.environ.get(LAG_ENV, DEFAULT_LAG_MS)) if lag_ms is None else float(lag_ms)
    dev = _DEVICE = LagDevice(_rank_index() if index is None else index, lag / 1e3)
    dev.select(dev.index)
    device_mod._SIMULATED["layer"] = lambda d: LagLayer(d, dev)

    def thread_device() -> Callable[[], Any]:
        index = dev.current_index()
        return lambda: dev.guard(index)

    device_mod._SIMULATED["thread_device"] = thread_device
    delegate_device.register_stream_wait(stream_wait)  # a delegate receive stalls this device's stream
    if kernels is None:
        kernels = os.environ.get(KERNELS_ENV, "") == "1"
    for mode in ((_Kernels(dev),) if kernels else ()) + (_HostReads(dev),):
        mode.__enter__()
        _MODES.append(mode)
    return dev


def uninstall() -> None:
    """Remove the simulated device (tests that install it in-process)."""
    global _DEVICE
    while _MODES:
        _MODES.pop().__exit__(None, None, None)
    device_mod._SIMULATED.pop("layer", None)
    device_mod._SIMULATED.pop("thread_device", None)
    delegate_device.register_stream_wait(None)
    if _DEVICE is not None:
        _DEVICE.close()
    _DEVICE = None


def install_from_env() -> LagDevice | None:
    """``TITAN_EXT_TEST_DEVICE=lag``: install the device, and the per-step accounting where
    ``TITAN_EXT_LAG_REPORT`` names a folder (idempotent)."""
    if os.environ.get(ENV_VAR, "") != "lag":
        return None
    if _DEVICE is not None:
        return _DEVICE
    dev = install()
    if os.environ.get(REPORT_ENV):
        install_accounting(Path(os.environ[REPORT_ENV]))
    return dev


def install_accounting(folder: Path) -> None:
    """One JSON line per optimizer step (``torch.optim`` step post-hook, on the training thread) to
    ``folder/rank<r>.jsonl``: ``{"step", "syncs": ["n x kind at site", ...], "behind", "violations"}``."""
    dev = device()
    folder.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", dev.index))
    path = folder / f"rank{rank}.jsonl"
    counter = host_syncs.counting()
    syncs = counter.__enter__()  # open for the whole run on the training thread
    _MODES.append(counter)  # (a generator context: dropping it would close the counter)
    state = {"step": 0, "violations": 0, "depth": 0}
    me = threading.get_ident()

    def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:  # noqa: ARG001
        if threading.get_ident() == me:
            state["depth"] += 1

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:  # noqa: ARG001
        """The end of the outermost optimizer step (TorchTitan's container steps each part's)."""
        if threading.get_ident() != me:
            return
        state["depth"] -= 1
        if state["depth"] > 0:
            return
        state["step"] += 1
        new = dev.violations[state["violations"]:]
        state["violations"] = len(dev.violations)
        line = {"step": state["step"], "syncs": syncs.sites(), "behind": dev.behind(), "violations": new}
        syncs.by_site.clear()
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(before_step)
    register_optimizer_step_post_hook(after_step)

    def at_exit() -> None:
        if dev.violations[state["violations"]:]:
            with open(path, "a") as f:
                f.write(json.dumps({"step": None, "violations": dev.violations[state["violations"]:]}) + "\n")

    atexit.register(at_exit)
