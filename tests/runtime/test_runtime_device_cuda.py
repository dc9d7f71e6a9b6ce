"""The device layer's CUDA implementation, on a fake CUDA whose stream runs behind the host
(``tests/_fake_cuda.py``; the CUDA rules of DESIGN.md).

* event times are put on the host clock through the anchor's *completion*, so an optimizer backlog
  that delays the device does not shift the timeline (a host clock read at enqueue would);
* ``wall_ms`` is the device's span of the iteration, read after its events resolved;
* resolving never synchronizes the device, and a non-blocking resolve never waits at all;
* every CUDA call runs under ``torch.cuda.device(<stage device>)``, also in the arrival watcher's thread;
* TorchTitan's ``pipeline/*`` timeline (``PipelineMonitor``) comes from device timings on CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch

from _fake_cuda import FakeGPU, install
from titan_ext.runtime.execute.device import CudaDevice, RecvHandle, device_layer
from titan_ext.runtime.measure.profiler import ActionRecord

BACKLOG_MS, F_MS = 50.0, 10.0


@pytest.fixture
def gpu(monkeypatch) -> FakeGPU:
    g = FakeGPU(index=1)
    install(monkeypatch, g)
    return g


def _iteration(timer, gpu: FakeGPU, n: int = 2) -> list[tuple[ActionRecord, float, float]]:
    """n forward kernels of F_MS each; returns (record, true device start, true device end)."""
    out = []
    timer.begin_iteration()
    for mb in range(n):
        rec = ActionRecord("F", 0, mb)
        token = timer.start(rec)
        true_start = max(gpu.stream_free, gpu.host)
        gpu.kernel(F_MS)
        true_end = gpu.stream_free
        timer.stop(rec, token)
        gpu.host_work(0.1)  # the host enqueues quickly and runs ahead
        out.append((rec, true_start, true_end))
    timer.end_iteration()
    return out


def test_event_times_follow_the_device_not_the_enqueue(gpu):
    timer = CudaDevice(torch.device("cuda", 1)).timer()
    with torch.cuda.device(torch.device("cuda", 1)):
        _iteration(timer, gpu)
        assert timer.resolve(block=True)
        gpu.kernel(BACKLOG_MS)  # the optimizer's kernels are still running when the next step is enqueued
        enqueued_at = gpu.host
        recs = _iteration(timer, gpu)
        assert timer.resolve(block=True)
    for rec, start, end in recs:
        assert rec.start == pytest.approx(start, abs=1e-9)
        assert rec.end == pytest.approx(end, abs=1e-9)
    assert recs[0][0].start - enqueued_at == pytest.approx(BACKLOG_MS / 1e3, abs=1e-6)
    # wall time: the device's span of the iteration (2 kernels), not the host's 0.2 ms of enqueueing
    assert timer.wall_ms == pytest.approx(2 * F_MS, abs=1e-6)
    assert gpu.device_syncs == 0
    assert gpu.violations == []


def test_non_blocking_resolve_never_waits(gpu):
    layer = device_layer(torch.device("cuda", 1))
    timer = layer.timer()
    with layer.context():
        _iteration(timer, gpu)  # start-up: the anchor waits once on its own event
        anchor_syncs = gpu.event_syncs
        assert timer.resolve(block=False) is False  # the device is still running the iteration
        assert math.isnan(timer.wall_ms)
        assert gpu.event_syncs == anchor_syncs and gpu.device_syncs == 0
        gpu.host_work(1e3)  # later: the device has finished
        assert timer.resolve(block=False) is True
        assert timer.wall_ms == pytest.approx(2 * F_MS, abs=1e-6)
        for _ in range(5):  # steady state: one iteration's events resolved without any sync
            _iteration(timer, gpu)
            gpu.host_work(1e3)
            assert timer.resolve(block=False)
    assert gpu.event_syncs == anchor_syncs and gpu.device_syncs == 0
    assert gpu.violations == []


def test_calls_outside_the_device_context_are_caught(gpu):
    """The fake's check works: an event recorded without ``torch.cuda.device(dev)`` is reported."""
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    assert gpu.violations and "Event.record" in gpu.violations[0]


class _FakeNcclRecv:
    """An NCCL receive: ``wait()`` is a stream wait (returns at once), ``is_completed()`` is truthful
    and, like NCCL's, queries a device event (so it needs the device in the calling thread)."""

    def __init__(self, gpu: FakeGPU, lands_at: float):
        self.gpu, self.lands_at, self.waits = gpu, lands_at, []

    def wait(self, timeout=None):  # noqa: ARG002
        self.gpu.check("Work.wait")
        self.waits.append(self.gpu.host)
        return True

    def is_completed(self):
        self.gpu.check("Work.is_completed")
        return self.gpu.host >= self.lands_at


def test_arrival_from_completion_and_wait_at_the_consumer(gpu):
    layer = CudaDevice(torch.device("cuda", 1))
    work = _FakeNcclRecv(gpu, lands_at=gpu.host + 0.060)
    handle = layer.watch(peer=0, works=[work])
    assert isinstance(handle, RecvHandle) and not handle.host_wait
    gpu.host_work(20.0)  # the consumer is not reached yet, nothing landed: nobody waited
    assert work.waits == []
    gpu.host_work(40.0)  # the data lands now; the watcher stamps it
    assert handle.arrival_time(timeout_s=10.0) == pytest.approx(work.lands_at, abs=1e-3)
    assert work.waits == []  # the watcher never calls wait(): that would be a stream wait here
    layer.wait_recv([handle])  # the consumer: the stream wait, now
    assert work.waits == [gpu.host]
    layer.close()
    assert gpu.violations == []


class _Stage:
    def __init__(self, gpu: FakeGPU):
        self.gpu, self.stage_index, self.num_stages, self.device = gpu, 0, 1, torch.device("cuda", 1)

    def forward_one_chunk(self, mb, *args, **kwargs):  # noqa: ARG002
        self.gpu.kernel(F_MS)

    def backward_one_chunk(self, mb, loss=None, full_backward=True, last_backward=False):  # noqa: ARG002
        self.gpu.kernel(2 * F_MS)

    def backward_weight_one_chunk(self, mb, *args, **kwargs):  # noqa: ARG002
        pass


class _Schedule:
    def __init__(self, stage):
        self._stages = [stage]

    def step(self):
        with torch.cuda.device(self._stages[0].device):
            for mb in range(2):
                self._stages[0].forward_one_chunk(mb)
            for mb in range(2):
                self._stages[0].backward_one_chunk(mb)


def test_titan_monitor_times_the_device_on_cuda(gpu):
    from titan_ext.titan.monitor import PipelineMonitor, timeline_stats

    mon = PipelineMonitor(_Schedule(_Stage(gpu)), None, clock=lambda: int(gpu.host * 1e9))
    gpu.kernel(BACKLOG_MS)  # a backlog before the step: the device starts 50 ms after the host
    mon.schedule.step()
    syncs = gpu.event_syncs
    tl = mon.gather(step=1)
    stats = timeline_stats(tl)
    assert stats["iteration_ms"] == pytest.approx(2 * F_MS + 4 * F_MS, rel=1e-6)  # device span, no backlog
    assert stats["busy_ms"][0] == pytest.approx(6 * F_MS, rel=1e-6)
    assert tl.step_wall_ms[0] == pytest.approx(6 * F_MS, rel=1e-6)
    assert gpu.event_syncs == syncs + 1 and gpu.device_syncs == 0  # the logging step waits on one event
    assert gpu.violations == []


WEEK_MS = 7 * 24 * 3600 * 1e3


def test_event_clock_keeps_a_tenth_of_a_millisecond_over_seven_days(gpu):
    """CUDA's ``elapsed_time`` is float32 milliseconds: measured from one start-up anchor, an event a
    week later is off by up to 32 ms (float32's spacing at 6e8 ms is 64 ms).  With a recent anchor
    (one per iteration, on an idle side stream) the times stay within 0.1 ms of the device's, with
    no host sync after start-up."""
    layer = device_layer(torch.device("cuda", 1))
    timer = layer.timer()
    with layer.context():
        _iteration(timer, gpu)
        assert timer.resolve(block=True)
        syncs = gpu.event_syncs
        for day in range(7):
            gpu.host_work(WEEK_MS / 7 - 1.234567)  # a day of training, off the ms grid
            gpu.kernel(BACKLOG_MS)  # and the device behind the host when the iteration is enqueued
            recs = _iteration(timer, gpu, n=3)
            gpu.host_work(1e3)
            assert timer.resolve(block=False)
            for rec, start, end in recs:
                assert abs(rec.start - start) <= 1e-4 / 1e3, (day, rec.start - start)
                assert abs(rec.end - end) <= 1e-4 / 1e3, (day, rec.end - end)
            assert timer.wall_ms == pytest.approx(3 * F_MS, abs=1e-4)
    assert gpu.event_syncs == syncs and gpu.device_syncs == 0  # steady state: no host sync at all
    assert gpu.violations == []


def test_an_anchor_the_device_processed_late_takes_the_chained_time(gpu):
    """An anchor stream that shares a hardware queue with a busy stream runs the anchor late: its
    host stamp (at record) is then early, and the time chained from the previous anchor is used."""
    layer = device_layer(torch.device("cuda", 1))
    timer = layer.timer()
    with layer.context():
        _iteration(timer, gpu)
        assert timer.resolve(block=True)
        for name in gpu.side_free:  # the anchor stream stuck behind 5 ms of someone else's work
            gpu.side_free[name] = gpu.host + 0.005
        recs = _iteration(timer, gpu)
        gpu.host_work(1e3)
        assert timer.resolve(block=False)
    for rec, start, end in recs:
        assert rec.start == pytest.approx(start, abs=1e-7) and rec.end == pytest.approx(end, abs=1e-7)
