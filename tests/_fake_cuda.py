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
as torch's own calls do when CUDA is real."""

from __future__ import annotations

import contextlib
import threading

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
