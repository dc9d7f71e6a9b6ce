"""An asynchronous-device simulation behind the device layer, for CPU tests.

What it simulates of a GPU + NCCL, on a CPU process:

* **Receives land later than their ``wait()`` returns** (:class:`SimAsyncTransport`): a receive is
  posted into a *shadow* buffer and the consumer's buffer is filled with NaN; ``wait()`` only enqueues a
  stream wait on the process's compute stream and returns at once (NCCL semantics); ``is_completed()``
  is truthful (the data has reached the shadow buffer).  The data becomes visible in the consumer's
  buffer only when the compute stream *executes* the wait, so a consumer that reads without a wait in
  front of it reads NaN (and is reported as a stale read).
* **One compute stream per process, shared by its threads** (:class:`SimStream`, like CUDA's default
  stream): a stream wait enqueued by any thread stalls the next operation of the stream — a kernel
  (:func:`sim_kernel`, the compute of :class:`SimComputeStage`) or an event record — until the data
  landed; that stall is the simulated device time the wait costs.
* **Events report stream times** (:class:`SimEvent`): an event's time is when the stream reached it
  (after the waits in front of it), so the device layer's event timer (``device._EventTimer``, the one
  CUDA uses) runs unchanged on the simulation.

The stream checks CUDA's ordering rule on every kernel: every stream wait executed since the previous
kernel must be consumed by this kernel (it reads the received buffer), else the wait sat *earlier* than
its consumer and stalled unrelated compute (``early_waits``); a kernel reading a received buffer whose
wait was never enqueued is a ``stale_read``.  Compute itself runs on the host (a kernel's duration is a
sleep), so the host is the stream's executor: what is simulated is where the stream stalls and what the
events report, which is what the runtime's measurements depend on.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from titan_ext.runtime.execute.device import POLL_MIN_S, DeviceLayer, RecvHandle, Timer, _EventTimer, backend_waits_land, now

__all__ = ["SimAsyncTransport", "SimComputeStage", "SimDevice", "SimEvent", "SimStream", "sim_kernel", "stream"]


class SimStream:
    """The simulated compute stream of one process, with its rule checks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pending: list["SimRecvWork"] = []  # enqueued stream waits not executed yet
        self.executed: list["SimRecvWork"] = []  # executed since the previous kernel
        self.unwaited: dict[int, "SimRecvWork"] = {}  # buffer data_ptr → receive without a wait yet
        self.kernels = 0
        self.early_waits: list[str] = []
        self.stale_reads: list[str] = []
        self.stalls: list[tuple[float, float]] = []  # (from, to) host-clock intervals the stream stalled

    def reset_checks(self) -> None:
        self.early_waits.clear()
        self.stale_reads.clear()
        self.stalls.clear()

    def register(self, work: "SimRecvWork") -> None:
        with self._lock:
            for t in work.reals:
                self.unwaited[t.data_ptr()] = work

    def enqueue_wait(self, work: "SimRecvWork") -> None:
        with self._lock:
            if work.enqueued:
                return
            work.enqueued = True
            work.wait_at_kernel = self.kernels
            for t in work.reals:
                self.unwaited.pop(t.data_ptr(), None)
            self.pending.append(work)

    def sync(self) -> None:
        """Execute the enqueued waits (stall until their data landed, then make it visible)."""
        with self._lock:
            pending, self.pending = self.pending, []
        t0 = now()
        for work in pending:
            work.land()
        if pending:
            self.stalls.append((t0, now()))
        with self._lock:
            self.executed.extend(pending)

    def kernel(self, reads: list[torch.Tensor], name: str) -> None:
        """A kernel reading ``reads``: executes the waits in front of it and checks the ordering rule."""
        self.sync()
        ptrs = {t.data_ptr() for t in reads}
        with self._lock:
            for work in self.executed:
                if not ptrs & {t.data_ptr() for t in work.reals}:
                    self.early_waits.append(f"wait for {work.name} (enqueued at kernel {work.wait_at_kernel}) "
                                            f"stalled kernel {self.kernels} ({name}), not its consumer")
            self.executed = []
            for p in ptrs & set(self.unwaited):
                self.stale_reads.append(f"kernel {self.kernels} ({name}) read {self.unwaited[p].name} "
                                        "before any wait on it")
            self.kernels += 1


_STREAM = SimStream()


def stream() -> SimStream:
    """This process's simulated compute stream."""
    return _STREAM


class SimEvent:
    """A timing event of the simulated stream: its time is when the stream reached it."""

    def __init__(self) -> None:
        self.t: float | None = None

    def record(self, stream_: Any = None) -> None:  # noqa: ARG002
        _STREAM.sync()
        self.t = now()

    def query(self) -> bool:
        return self.t is not None

    def synchronize(self) -> None:
        if self.t is None:
            raise RuntimeError("SimEvent.synchronize() before record()")

    def elapsed_time(self, end: "SimEvent") -> float:
        if self.t is None or end.t is None:
            raise RuntimeError("SimEvent.elapsed_time() of an unrecorded event")
        return 1e3 * (end.t - self.t)


class SimDevice(DeviceLayer):
    """The device layer on the simulation: event timer, stream waits, truthful-completion arrival."""

    wait_lands = False
    asynchronous = True

    def set_backend(self, backend: str) -> None:  # noqa: ARG002
        """The simulated receives have NCCL semantics whatever the group's backend."""

    def compute_stream(self) -> Any:
        return _STREAM

    def event(self) -> Any:
        return SimEvent()

    def timer(self) -> Timer:
        return _EventTimer(self)


class SimRecvWork:
    """One RECV action's works (NCCL semantics): ``wait()`` enqueues a stream wait and returns."""

    def __init__(self, inner: list[Any], shadows: list[torch.Tensor], reals: list[torch.Tensor], name: str,
                 latency_s: float = 0.0, host_wait: bool = True):
        self.inner, self.shadows, self.reals, self.name = inner, shadows, reals, name
        self.latency_s = latency_s
        self._probe = RecvHandle(inner, host_wait=host_wait)  # how the inner works' landing is observed
        self.enqueued = False
        self.wait_at_kernel = -1
        self._landed = threading.Event()
        self._visible = False
        self.error: BaseException | None = None
        threading.Thread(target=self._comm_stream, daemon=True, name=f"sim-comm-{name}").start()

    def _comm_stream(self) -> None:
        try:
            while not self._probe.landed():
                time.sleep(POLL_MIN_S)
            if self.latency_s > 0:  # the link's latency, emulated at the receiver (NCCL's order kept)
                time.sleep(self.latency_s)
        except BaseException as exc:  # noqa: BLE001 - surfaced when the stream executes the wait
            self.error = exc
        self._landed.set()

    def wait(self, timeout: Any = None) -> bool:  # noqa: ARG002
        _STREAM.enqueue_wait(self)
        return True

    def is_completed(self) -> bool:
        return self._landed.is_set()

    def land(self) -> None:
        self._landed.wait()
        if self.error is not None:
            raise self.error
        if not self._visible:
            with torch.no_grad():
                for real, shadow in zip(self.reals, self.shadows):
                    real.copy_(shadow)
            self._visible = True


class SimAsyncTransport:
    """Wraps a transport: receives become :class:`SimRecvWork` (land later than ``wait()``), and
    land ``latency_ms[link]`` later than the transport delivered them (link ``i`` joins ranks ``i``,
    ``i+1`` of the default group: receiver-side emulation of a slow link, every op still issued by the
    main thread in the plan's order)."""

    def __init__(self, inner: Any, latency_ms: dict[int, float] | None = None):
        self.inner = inner
        self.latency_ms = dict(latency_ms or {})
        if any(v < 0 for v in self.latency_ms.values()):
            raise ValueError(f"SimAsyncTransport: negative latency in {self.latency_ms}")

    def issue(self, action: Any, ops: list[dist.P2POp]) -> list[Any]:
        recvs = [op for op in ops if getattr(op.op, "__name__", "") == "irecv"]
        if not recvs:
            return self.inner.issue(action, ops)
        if len(recvs) != len(ops):
            raise ValueError("SimAsyncTransport: a RECV action with sends in it")
        # the simulated device's receive buffers: on the consumer buffer's device (device tensors)
        shadows = [torch.empty_like(op.tensor, device=op.tensor.device) for op in ops]
        reals = [op.tensor for op in ops]
        with torch.no_grad():
            for t in reals:
                t.fill_(float("nan"))  # stale data: what a consumer without a wait would read
        shadow_ops = [dist.P2POp(op.op, s, op.peer, op.group, op.tag) for op, s in zip(ops, shadows)]
        link = min(dist.get_rank(), ops[0].peer)
        latency = self.latency_ms.get(link, 0.0) / 1e3 if abs(dist.get_rank() - ops[0].peer) == 1 else 0.0
        work = SimRecvWork(self.inner.issue(action, shadow_ops), shadows, reals, str(action), latency,
                           host_wait=backend_waits_land(dist.get_backend(ops[0].group)))
        _STREAM.register(work)
        return [work]

    def close(self) -> None:
        self.inner.close()


def sim_kernel(x: torch.Tensor, fwd_ms: float, bwd_ms: float, name: str) -> torch.Tensor:
    """Identity whose forward and backward are kernels of the simulated stream (sleeping ``*_ms``)."""
    return _SimKernel.apply(x, fwd_ms / 1e3, bwd_ms / 1e3, name)


class _SimKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd_s: float, bwd_s: float, name: str):  # type: ignore[override]
        _STREAM.kernel([x], f"{name}.forward")
        if fwd_s > 0:
            time.sleep(fwd_s)
        ctx.bwd_s, ctx.name = bwd_s, name
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        _STREAM.kernel([grad], f"{ctx.name}.backward")
        if ctx.bwd_s > 0:
            time.sleep(ctx.bwd_s)
        return grad, None, None, None


class SimComputeStage(nn.Module):
    """:class:`~titan_ext.testing.models.SleepComputeStage` on the simulated stream: F, I and W are
    kernels; the first kernel of F reads the received activation, the first of I the received gradient."""

    def __init__(self, dim: int, f_ms: float, i_ms: float, w_ms: float, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(dim, dim, generator=gen) / dim ** 0.5)
        self.f_ms, self.i_ms, self.w_ms = f_ms, i_ms, w_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = sim_kernel(x, 0.0, 0.0, "F.in")
        w = sim_kernel(self.weight, 0.0, self.w_ms, "W")
        h = torch.tanh(x @ w)
        return sim_kernel(h, self.f_ms, self.i_ms, "F/I")
