"""The delegate data plane's GPU rules, checked on CPU.

No GPU here: the CUDA entry points the pool calls (``torch.cuda.device``/``stream``/``current_stream``,
the extension's copy+signal kernels) are replaced by recorders (``tests/_fake_cuda.py``), and the tests
assert *which device and which stream* each call was made under, from which thread — the facts a GPU
run depends on.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch
import torch.distributed as dist

from titan_ext.runtime.comm.delegate import ring as R
from titan_ext.runtime.comm.delegate import transport as T
from titan_ext.runtime.comm.delegate.pool import Channel

from _fake_cuda import FakeCudaTensor, FakeEvent, record_cuda, recorded_layer

DEV = torch.device("cuda", 1)   # the stage's device: not device 0, which every new thread starts on


@pytest.fixture
def cuda(monkeypatch):
    return record_cuda(monkeypatch)


class _Region:
    def __init__(self, cuda):
        self.cuda = cuda

    def cuda_register(self):
        self.cuda.record("cuda_register")

    def d2h_signal(self, src, data_off, flag_off, value):
        self.cuda.record("d2h_signal")

    def h2d_signal(self, data_off, dst, host_flag_off, host_value, dev_flag, dev_value):
        self.cuda.record("h2d_signal")


def _fake_ring(cuda):
    ring = types.SimpleNamespace(region=_Region(cuda), num_slots=2, slot_bytes=4096,
                                 geometry=R.RingGeometry(2, 4096))
    ring.state = lambda i: R.FREE
    ring.set_state = lambda i, v, wake=True: None
    ring.write_header = lambda i, seq, t, due_ns=0: 16
    ring.state_offset = lambda i: 0
    ring.error_text = lambda: ""
    return ring


def test_respawned_lane_allocates_its_flags_on_the_stage_device_from_a_supervisor_thread(cuda, monkeypatch):
    """Defect 7: the supervisor thread (current device 0) must name the stage's device for the new
    lane's cudaHostRegister and device flags."""
    from titan_ext.runtime.comm.delegate.lanes import LaneProcesses

    monkeypatch.setattr(R.SlotRing, "create", classmethod(lambda cls, n, b: _fake_ring(cuda)))
    procs = LaneProcesses("p", 2, 4096, ("127.0.0.1", 1), 60.0, 10.0, recorded_layer(cuda, DEV))
    t = threading.Thread(target=procs.new_lane, args=(Channel(0, 1, "F"), 0, "send", 1), name="supervisor")
    t.start()
    t.join()
    by = {c[0]: c for c in cuda.calls}
    assert by["zeros"][4]["device"] == DEV and by["zeros"][3] == "supervisor"
    assert by["cuda_register"][1] == DEV and by["zeros"][1] == DEV, cuda.calls


class _Healthy:
    """Recovery stand-in: every lane is usable."""

    enabled = False

    def lane_ok(self, link, lane):
        pass

    def wait_slot(self, *a):
        pass


def test_sends_and_receives_use_their_own_copy_streams_on_the_stage_device(cuda, monkeypatch):
    """"One shared copy stream makes D2H sends queue behind H2D receives": D2H on one stream, H2D
    (issued from an arrival-watcher thread) on another, both under the stage's device.  (Where the
    consumer's stream waits: tests/runtime/test_delegate_runahead.py.)"""
    from titan_ext.runtime.comm.delegate.recvpath import Recv, RecvMatcher
    from titan_ext.runtime.comm.delegate.sendpath import SendPath

    layer = recorded_layer(cuda, DEV)
    sender = SendPath({}, _Healthy(), layer, 60.0)
    receiver = RecvMatcher({}, _Healthy(), threading.RLock(), layer, 60.0)
    ring = _fake_ring(cuda)
    lane = types.SimpleNamespace(ring=ring, cursor=0, keep=[None, None], tokens=[0, 0],
                                 dev_flags=torch.zeros(2, dtype=torch.int32))
    sender.ring_send(types.SimpleNamespace(error=None), lane, FakeCudaTensor(), 0)
    h = Recv(receiver, (0, "F"), 0, FakeCudaTensor())
    h.free_ev = FakeEvent(cuda)
    t = threading.Thread(target=receiver.h2d, args=(lane, 1, h), name="watcher")
    t.start()
    t.join()
    by = {c[0]: c for c in cuda.calls}
    d2h, h2d = by["d2h_signal"], by["h2d_signal"]
    assert d2h[2] is sender.stream and h2d[2] is receiver.stream and d2h[2] is not h2d[2]
    assert d2h[1] == DEV and h2d[1] == DEV and h2d[3] == "watcher", cuda.calls
    assert "stream_wait_flag" not in by   # the watcher never touches the consumer's stream


def test_cuda_graph_capture_is_refused_with_a_clear_error(cuda, monkeypatch):
    from titan_ext.runtime.comm.delegate.recvpath import RecvMatcher
    from titan_ext.runtime.comm.delegate.sendpath import SendPath

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    links = {(1, "F"): [types.SimpleNamespace()]}
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        SendPath(links, _Healthy(), recorded_layer(cuda, DEV), 60.0).send(FakeCudaTensor(), 1, "F", 0)
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        RecvMatcher(links, _Healthy(), threading.RLock(), recorded_layer(cuda, DEV), 60.0).post_recv(FakeCudaTensor(), 1, "F", 0)
    assert not [c for c in cuda.calls if c[0].endswith("signal")]


def test_failover_is_refused_and_fallback_off_on_an_nccl_pp_group(monkeypatch):
    """Defect 4: on NCCL a hung send does not raise and the fallback's host markers, tags and
    supervisor-thread ops break its rules — the router's per-op failover is refused (the schedule's
    failover is step-level there: tests/runtime/test_delegate_nccl_failover.py), a dead delegate is a clean stop."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    enabled = []
    fake_pool = types.SimpleNamespace(enable_fallback=lambda group=None: enabled.append(group))
    with pytest.raises(ValueError, match="NCCL"):
        T.P2PRouter(0, fake_pool, failover=True)
    router = T.P2PRouter(0, fake_pool, delegating=True)
    assert router.delegate_fallback is False and enabled == []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert T.P2PRouter(0, fake_pool, delegating=True).delegate_fallback is True and len(enabled) == 1


def test_slot_size_is_the_largest_message_rounded_to_a_page():
    from titan_ext.runtime.comm.delegate.schedule import message_slot_bytes

    assert message_slot_bytes(0) == R.PAGE
    assert message_slot_bytes(1) == R.PAGE
    assert message_slot_bytes(R.PAGE) == R.PAGE
    llama_8b = 1 * 8192 * 4096 * 2   # microbatch 1, sequence 8192, hidden 4096, bf16: 64 MiB
    assert message_slot_bytes(llama_8b) == 64 << 20 and message_slot_bytes(llama_8b + 1) == (64 << 20) + R.PAGE
    with pytest.raises(ValueError):
        message_slot_bytes(-1)


def test_a_receive_whose_message_another_thread_took_does_not_wait_for_it_again():
    """Under NCCL's rules the device layer's arrival watcher polls ``is_completed()`` (which takes ready
    messages) while the consumer waits in ``wait()``: if the watcher takes the message just after the
    consumer chose the slot to wait on, the consumer must notice, not wait for that slot's next
    message (found as a stall of delegation="auto" under the NCCL-rules backend)."""
    import time

    from titan_ext.runtime.comm.delegate.lanes import Lane
    from titan_ext.runtime.comm.delegate.link import Link
    from titan_ext.runtime.comm.delegate.recovery import Recovery
    from titan_ext.runtime.comm.delegate.recvpath import RecvMatcher

    ch = Channel(0, 1, "F")
    lane = Lane(ch, 0, "recv", R.SlotRing.create(2, 4096))
    link = Link(ch, 0, "recv", 1, lane)
    lock = threading.RLock()
    procs = types.SimpleNamespace(layer=None, closed=False, check=lambda lane: None, heartbeat_timeout_s=10.0)
    recovery = Recovery(1, procs, lambda: [link], lock)
    matcher = RecvMatcher({(0, "F"): [link]}, recovery, lock, None, 5.0)
    recovery.receiver = matcher
    real_wait = recovery.wait_slot

    def watcher_wins(link_, lane_, i, want, *a, **kw):  # the message lands and the watcher takes it
        if lane_.ring.state(i) == R.FREE and not matcher.poll(0, "F", 0):
            msg = torch.full((4,), 7.0)
            lane_.ring.write_header(i, 0, msg)
            lane_.ring.copy_in(i, msg, 16)
            lane_.ring.set_state(i, R.READY, wake=False)
            assert matcher.poll(0, "F", 0)   # taken by "the watcher": slot i is FREE again
        return real_wait(link_, lane_, i, want, *a, **kw)

    recovery.wait_slot = watcher_wins
    h = matcher.post_recv(torch.zeros(4), 0, "F", 0)
    t0 = time.monotonic()
    h.wait(timeout=3.0)
    assert time.monotonic() - t0 < 2.0 and torch.equal(h.tensor, torch.full((4,), 7.0))
