"""A fake CUDA for testing the device layer's CUDA logic on CPU: one device whose compute stream runs
kernels later than the host enqueues them (a backlog), on a virtual host clock.

Side streams (``torch.cuda.Stream``) are idle unless a test gives them work: an event recorded on
one completes when the host records it.  ``Event.elapsed_time`` returns **float32** milliseconds,
as ``cudaEventElapsedTime`` does (its result is a C ``float``): a span of hours loses sub-millisecond
resolution, which is what the device layer's anchors must cope with.

Every event call checks that it runs under ``torch.cuda.device(<the stage's device>)`` in its thread
(the "device per call, from any thread" rule).  ``synchronize`` of an event advances the host clock
to the event's completion; ``torch.cuda.synchronize`` (a full device sync) is counted and forbidden
on the paths under test.  Both report to the host-sync accounting (``titan_ext.testing.host_syncs.record``),
as torch's own calls do when CUDA is real.

:class:`CudaRecorder` (installed by :func:`record_cuda`) is the other fake, for the delegate data plane:
it runs nothing, it records each CUDA call the code under test makes with the device and stream it
was made under and from which thread (tests/runtime/test_delegate_gpu_rules.py,
tests/runtime/test_delegate_runahead.py)."""

from __future__ import annotations

import contextlib
import threading
import types

import numpy as np
import torch

from titan_ext.testing import host_syncs


class FakeGPU:
    def __init__(self, index: int = 0):
        self.index = index
        self.host = 100.0  # virtual host clock (s)
        self.stream_free = self.host  # when the compute stream has run everything enqueued
        self.side_free: dict[str, float] = {}  # side streams: when each has run everything enqueued
        self.event_syncs = 0
        self.device_syncs = 0
        self.violations: list[str] = []
        self._tls = threading.local()

    # -- the host and the stream ---------------------------------------------------------------
    def now(self) -> float:
        return self.host

    def host_work(self, ms: float) -> None:
        self.host += ms / 1e3

    def kernel(self, ms: float) -> None:
        self.stream_free = max(self.stream_free, self.host) + ms / 1e3

    # -- torch.cuda stand-ins ------------------------------------------------------------------
    def check(self, what: str) -> None:
        dev = getattr(self._tls, "device", None)
        if dev != self.index:
            self.violations.append(f"{what} in thread {threading.current_thread().name} under device {dev}")

    @contextlib.contextmanager
    def device(self, dev):
        prev = getattr(self._tls, "device", None)
        self._tls.device = torch.device(dev).index
        try:
            yield
        finally:
            self._tls.device = prev

    def synchronize(self, *args, **kwargs):  # noqa: ARG002
        host_syncs.record("torch.cuda.synchronize")
        self.device_syncs += 1
        self.host = max(self.host, self.stream_free)

    def Stream(self, device=None, priority=0):  # noqa: N802 - torch.cuda.Stream
        name = f"side-stream-{len(self.side_free)}"
        self.side_free[name] = self.host
        return name

    def Event(self, enable_timing: bool = False):  # noqa: N802 - torch.cuda.Event
        gpu = self

        class _Event:
            def __init__(self):
                self.t = None

            def record(self, stream=None):
                gpu.check("Event.record")
                if stream in gpu.side_free:
                    self.t = max(gpu.side_free[stream], gpu.host)
                    gpu.side_free[stream] = self.t
                    return
                self.t = max(gpu.stream_free, gpu.host)
                gpu.stream_free = self.t

            def query(self):
                gpu.check("Event.query")
                return self.t is not None and gpu.host >= self.t

            def synchronize(self):
                gpu.check("Event.synchronize")
                host_syncs.record("Event.synchronize")
                gpu.event_syncs += 1
                gpu.host = max(gpu.host, self.t)

            def elapsed_time(self, end):
                gpu.check("Event.elapsed_time")
                if not (self.query() and end.query()):
                    raise RuntimeError("elapsed_time of an incomplete event")
                return float(np.float32(1e3 * (end.t - self.t)))  # CUDA: a C float of milliseconds

        if not enable_timing:
            raise AssertionError("timing events must be created with enable_timing=True")
        return _Event()


def install(monkeypatch, gpu: FakeGPU) -> None:
    """Route torch.cuda and the device layer's host clock to ``gpu``."""
    from titan_ext.runtime.execute import device as device_mod

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", gpu.Event)
    monkeypatch.setattr(torch.cuda, "Stream", gpu.Stream)
    monkeypatch.setattr(torch.cuda, "device", gpu.device)
    monkeypatch.setattr(torch.cuda, "synchronize", gpu.synchronize)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: "compute-stream")
    monkeypatch.setattr(device_mod, "now", gpu.now)


# -- recorders of the CUDA calls (the delegate data plane) -----------------------------------------
class CudaRecorder:
    """Records calls as ``(what, device, stream, thread name, info)``: the ``torch.cuda.device`` and
    ``torch.cuda.stream`` in force in the calling thread (or the stream the call names)."""

    def __init__(self):
        self.local = threading.local()
        self.calls: list[tuple] = []
        self.lock = threading.Lock()
        self.compute = FakeStream("compute", self)   # the current stream outside a torch.cuda.stream

    def ctx(self, attr, value):
        @contextlib.contextmanager
        def cm():
            old = getattr(self.local, attr, None)
            setattr(self.local, attr, value)
            try:
                yield
            finally:
                setattr(self.local, attr, old)
        return cm()

    def record(self, what, stream=None, **info):
        stream = stream if stream is not None else getattr(self.local, "stream", None)
        with self.lock:
            self.calls.append((what, getattr(self.local, "device", None), stream,
                               threading.current_thread().name, info))

    def of(self, what):
        with self.lock:
            return [c for c in self.calls if c[0] == what]


class FakeStream(str):
    """A CUDA stream that is its name (a recorded call's stream compares equal to ``"compute"``, and is
    the stream object the code used); the waits enqueued on it are recorded."""

    def __new__(cls, name, cuda):
        stream = super().__new__(cls, name)
        stream.cuda = cuda
        return stream

    @property
    def name(self):
        return str(self)

    def wait_stream(self, other):
        self.cuda.record("wait_stream", stream=self, other=other.name)

    def wait_event(self, ev):
        self.cuda.record("wait_event", stream=self, event=ev)


class FakeEvent:
    def __init__(self, cuda):
        self.cuda, self.stream = cuda, None

    def record(self, stream=None):
        self.stream = stream
        self.cuda.record("event_record", stream=stream, event=self)

    def query(self):
        return True


class FakeCudaTensor:
    """A 4-element float32 tensor that says it is on the GPU."""

    is_cuda = True
    dtype = torch.float32
    shape = (4,)

    def contiguous(self):
        return self

    def is_contiguous(self):
        return True

    def record_stream(self, s):
        pass

    def numel(self):
        return 4

    def element_size(self):
        return 4

    def dim(self):
        return 1


def record_cuda(monkeypatch) -> CudaRecorder:
    """Route ``torch.cuda``'s device/stream contexts, events, ``torch.zeros(device="cuda")`` and the
    extension's ``stream_wait_flag`` to a new :class:`CudaRecorder`."""
    from titan_ext.runtime.comm.delegate import recvpath

    c = CudaRecorder()
    monkeypatch.setattr(torch.cuda, "device", lambda d: c.ctx("device", torch.device(d)))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: c.ctx("stream", s))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: getattr(c.local, "stream", None) or c.compute)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **kw: FakeEvent(c))
    real_zeros = torch.zeros

    def zeros(*a, device=None, **kw):
        if device is not None and torch.device(device).type == "cuda":
            c.record("zeros", device=torch.device(device))
            return real_zeros(*a, **kw)
        return real_zeros(*a, device=device, **kw)

    monkeypatch.setattr(torch, "zeros", zeros)
    monkeypatch.setattr(recvpath, "load_ext", lambda: types.SimpleNamespace(
        stream_wait_flag=lambda flag, v: c.record("stream_wait_flag", flag=flag, value=v)))
    return c


def recorded_layer(cuda: CudaRecorder, device: torch.device):
    """The executor's CUDA device layer on ``device`` (its context() is ``torch.cuda.device(device)``),
    with named :class:`FakeStream` streams that need no GPU."""
    from titan_ext.runtime.execute.device import CudaDevice

    class Layer(CudaDevice):
        def stream(self, name):
            return self._streams.setdefault(name, FakeStream(name, cuda))

    return Layer(device)
