"""The delegate data plane never blocks the training thread ("the delegate receive path").

On a GPU the host must run ahead of the device.  The CUDA paths are checked on CPU with recorders of the
CUDA calls (``tests/_fake_cuda.py``, as tests/runtime/test_delegate_gpu_rules.py does): which thread made
each call, under which device, on which stream — and whether the host returned before the message was
there.  The CPU path and the
host-sync accounting run on two ranks under the ``nccl_rules`` backend.

Defects pinned (each test fails on the code before the fix):
1. a receive's consumer wait blocked the host until the message was in the ring;
2. an early arrival was cloned into pageable memory and later copied with a blocking ``copy_``;
3. the H2D run from an arrival-watcher thread put its spin-wait on the compute stream wherever the
   message arrived, not in front of its consumer;
4. a full send ring blocked the host;
5. ring tensors made by the C++ extension passed for device tensors, so none of it was counted.
"""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch
import torch.nn.functional as Fn

from titan_ext.runtime.comm.delegate import ring as R
from titan_ext.runtime.comm.delegate.pool import Channel

from _fake_cuda import FakeCudaTensor, record_cuda, recorded_layer

pytestmark = pytest.mark.timeout(240)

DEV = torch.device("cuda", 1)   # the stage's device: not device 0, which every new thread starts on
KEY = (0, "F")


class _Region:
    """A real ring's region, with recorders for the CUDA-only methods."""

    def __init__(self, region, cuda):
        self._region, self.cuda = region, cuda

    def __getattr__(self, name):
        return getattr(self._region, name)

    def h2d_signal(self, data_off, dst, host_flag_off, host_value, dev_flag, dev_value):
        self.cuda.record("h2d_signal", data_off=data_off, host_flag_off=host_flag_off, dev_flag=dev_flag,
                         dev_value=dev_value)

    def d2h_signal(self, src, data_off, flag_off, value):
        self.cuda.record("d2h_signal", data_off=data_off)


@pytest.fixture
def cuda(monkeypatch):
    return record_cuda(monkeypatch)


def _recv_side(cuda, timeout_s=5.0):
    """A recv link over a real ring (4 slots, its CUDA methods recorded) and its matcher, built on this
    (the training) thread."""
    from titan_ext.runtime.comm.delegate.lanes import Lane
    from titan_ext.runtime.comm.delegate.link import Link
    from titan_ext.runtime.comm.delegate.recovery import Recovery
    from titan_ext.runtime.comm.delegate.recvpath import RecvMatcher

    ch = Channel(0, 1, "F")
    ring = R.SlotRing.create(4, 4096)
    ring.region = _Region(ring.region, cuda)
    lane = Lane(ch, 0, "recv", ring)
    lane.dev_flags = torch.zeros(4, dtype=torch.int32)
    link = Link(ch, 0, "recv", 1, lane)
    lock = threading.RLock()
    procs = types.SimpleNamespace(layer=None, closed=False, check=lambda lane: None, heartbeat_timeout_s=10.0)
    recovery = Recovery(1, procs, lambda: [link], lock)
    matcher = RecvMatcher({KEY: [link]}, recovery, lock, recorded_layer(cuda, DEV), timeout_s)
    recovery.receiver = matcher
    return matcher, ring


def _deliver(ring, i, seq, value=7.0):
    """What the recv delegate does: the message into slot ``i``, then READY."""
    msg = torch.full((4,), value)
    ring.write_header(i, seq, msg)
    ring.copy_in(i, msg, 16)
    ring.set_state(i, R.READY)


def _until(pred, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


# -- 1 + 3: a late message --------------------------------------------------------------------------
def test_a_late_message_makes_the_consumer_stream_wait_on_the_device_not_the_host(cuda):
    """Defect 1: the consumer's wait on a message not yet in the ring returns at once; the compute stream
    waits on the device (the extension's spin-wait on a flag word), placed by the training thread; the
    message is taken when it lands (the receive pump) and its H2D, on the H2D stream under the stage's
    device, sets exactly the word and token the compute stream waits for."""
    matcher, ring = _recv_side(cuda, timeout_s=5.0)
    h = matcher.post_recv(FakeCudaTensor(), *KEY, 0)
    t0 = time.monotonic()
    h.wait()   # before the fix: blocks until the message is in the ring (here: 5 s, then DelegateTimeout)
    assert time.monotonic() - t0 < 2.0
    (spin,) = cuda.of("stream_wait_flag")
    assert spin[1:4] == (DEV, "compute", "MainThread"), spin
    assert not cuda.of("h2d_signal")      # nothing arrived yet
    _deliver(ring, 0, 0)                  # the message lands after its consumer was enqueued
    _until(lambda: cuda.of("h2d_signal"))
    (h2d,) = cuda.of("h2d_signal")
    assert h2d[1] == DEV and h2d[2] == "delegate-h2d" and h2d[3] != "MainThread", h2d
    flag, token = spin[4]["flag"], spin[4]["value"]
    assert h2d[4]["dev_flag"].data_ptr() == flag.data_ptr() and h2d[4]["dev_value"] == token
    # only the training thread ever touched the compute stream; the H2D waited on the buffer's
    # posting-time event, never on the compute stream's tail (which holds the spin-wait: a deadlock)
    assert all(c[3] == "MainThread" for c in cuda.calls if c[2] == "compute"), cuda.calls
    assert not [c for c in cuda.of("wait_stream") if c[2] == "delegate-h2d" and c[4]["other"] == "compute"], \
        cuda.calls
    (free,) = [c for c in cuda.of("wait_event") if c[2] == "delegate-h2d"]
    assert free[4]["event"] is h.free_ev and h.free_ev.stream == "compute"
    matcher.close()


def test_a_message_taken_by_an_arrival_watcher_is_waited_for_just_before_its_consumer(cuda):
    """Defect 3: an arrival watcher (the device layer polls ``is_completed()`` from its own thread) that
    takes the message enqueues the H2D on the H2D stream and nothing on the compute stream; the compute
    stream's wait — on the event after the copy — is placed by the consumer's wait on the training
    thread."""
    matcher, ring = _recv_side(cuda)
    h = matcher.post_recv(FakeCudaTensor(), *KEY, 0)
    _deliver(ring, 0, 0)
    watcher = threading.Thread(target=h.is_completed, name="watcher")
    watcher.start()
    watcher.join()
    assert h.is_completed()
    by_watcher = [c for c in cuda.calls if c[3] == "watcher"]
    assert {c[0] for c in by_watcher} >= {"h2d_signal", "event_record"}, by_watcher
    assert all(c[1] == DEV for c in by_watcher), by_watcher
    assert not [c for c in by_watcher if c[2] == "compute"], by_watcher   # before the fix: its spin-wait
    h.wait()
    waits = [c for c in cuda.calls if c[2] == "compute" and c[0] in ("wait_event", "stream_wait_flag")]
    assert len(waits) == 1 and waits[0][0] == "wait_event" and waits[0][3] == "MainThread", waits
    assert waits[0][4]["event"] is h.event and h.event.stream == "delegate-h2d"


# -- 2: an early arrival ----------------------------------------------------------------------------
def test_an_early_arrival_stays_in_its_pinned_slot_and_goes_up_asynchronously(cuda):
    """Defect 2: a message that arrives before its receive is posted stays in its (pinned, registered)
    ring slot — no pageable clone — and, once posted, goes up by the H2D + signal from that slot on the
    H2D stream (the slot is freed by the copy's kernel); the consumer stream waits on its event."""
    matcher, ring = _recv_side(cuda)
    _deliver(ring, 0, 0)
    assert matcher.arrived(*KEY, 0)      # taken as an early arrival
    assert ring.state(0) == R.BUSY       # before the fix: cloned into pageable memory and the slot freed
    h = matcher.post_recv(FakeCudaTensor(), *KEY, 0)   # before the fix: a blocking h.tensor.copy_(clone)
    (h2d,) = cuda.of("h2d_signal")
    assert h2d[2] == "delegate-h2d" and h2d[1] == DEV
    assert h2d[4]["data_off"] == ring.geometry.slot_offset(0) + R.SLOT_PAYLOAD
    assert h2d[4]["host_flag_off"] == ring.state_offset(0)
    h.wait()
    (w,) = [c for c in cuda.calls if c[2] == "compute" and c[0] == "wait_event"]
    assert w[4]["event"] is h.event and not cuda.of("stream_wait_flag")


# -- 4: a full send ring ----------------------------------------------------------------------------
def _send_side(layer=None, slots=2, timeout_s=3.0, region=None):
    from titan_ext.runtime.comm.delegate.lanes import Lane
    from titan_ext.runtime.comm.delegate.link import Link
    from titan_ext.runtime.comm.delegate.recovery import Recovery
    from titan_ext.runtime.comm.delegate.sendpath import SendPath

    ch = Channel(0, 1, "F")
    ring = R.SlotRing.create(slots, 4096)
    if region is not None:
        ring.region = region(ring.region)
    lane = Lane(ch, 0, "send", ring)
    link = Link(ch, 0, "send", 1, lane)
    procs = types.SimpleNamespace(layer=layer, closed=False, check=lambda lane: None, heartbeat_timeout_s=10.0)
    recovery = Recovery(0, procs, lambda: [link], threading.RLock())
    return SendPath({(1, "F"): [link]}, recovery, layer, timeout_s), ring


def test_a_full_send_ring_queues_the_message_instead_of_blocking_the_host():
    """Defect 4: with both slots taken (the delegate is behind), further sends return at once; the send
    pump writes them, in order and intact, as the delegate frees slots."""
    sender, ring = _send_side(slots=2, timeout_s=3.0)
    msgs = [torch.arange(4, dtype=torch.float32) + 10 * k for k in range(6)]
    t0 = time.monotonic()
    for k, m in enumerate(msgs):
        sender.send(m, 1, "F", k)   # before the fix: the third blocks 3 s, then DelegateTimeout
    assert time.monotonic() - t0 < 1.0
    assert sender.queued_total == 4 and sender.pending() == 4
    got, i = [], 0
    while len(got) < len(msgs):   # the send delegate: READY slots in ring order, then FREE
        assert ring.wait_state(i, R.READY, 10.0) == 0
        seq, nbytes, dtype, shape = ring.read_header(i)
        got.append((seq, ring.typed_view(i, dtype, shape).clone()))
        ring.set_state(i, R.FREE)
        i = (i + 1) % ring.num_slots
    assert [s for s, _ in got] == list(range(6))
    assert all(torch.equal(t, m) for (_, t), m in zip(got, msgs))
    assert sender.pending() == 0
    sender.close()


def test_a_queued_cuda_send_copies_what_the_compute_stream_had_at_the_send(cuda):
    """The pump enqueues a queued message's D2H on the D2H stream under the stage's device, behind the
    event the training thread recorded on the compute stream at the send (not the stream's tail then)."""
    sender, ring = _send_side(layer=recorded_layer(cuda, DEV), slots=1, region=lambda r: _Region(r, cuda))
    sender.send(FakeCudaTensor(), 1, "F", 0)    # into the free slot, from this thread
    sender.send(FakeCudaTensor(), 1, "F", 1)    # ring full: queued
    assert len(cuda.of("d2h_signal")) == 1 and sender.pending() == 1
    ready = [c[4]["event"] for c in cuda.of("event_record") if c[2] == "compute"]
    assert len(ready) == 2
    ring.set_state(0, R.FREE)                    # the delegate sent message 0 (the GPU set READY: faked)
    _until(lambda: len(cuda.of("d2h_signal")) == 2)
    d2h = cuda.of("d2h_signal")[1]
    assert d2h[1] == DEV and d2h[2] == "delegate-d2h" and d2h[3] == "titan_ext-delegate-send-pump", d2h
    waits = [c for c in cuda.of("wait_event") if c[3] == "titan_ext-delegate-send-pump"]
    assert len(waits) == 1 and waits[0][2] == "delegate-d2h" and waits[0][4]["event"] is ready[1]
    assert not [c for c in cuda.calls if c[3] == "titan_ext-delegate-send-pump" and c[2] == "compute"]
    sender.close()


# -- 5: ring tensors are host tensors ---------------------------------------------------------------
def test_ring_tensors_are_host_tensors_and_a_blocking_copy_from_them_is_counted(monkeypatch):
    """Defect 5: the views of a ring (made by the C++ extension, which no torch factory saw) are marked
    as host tensors for ``nccl_rules``, so the host-sync accounting counts a blocking copy between a slot
    and a device buffer (and not the ``non_blocking`` one from the pinned slot)."""
    from titan_ext.testing import host_syncs
    from titan_ext.testing import nccl_rules

    monkeypatch.setattr(nccl_rules, "_installed", True)
    monkeypatch.setattr(R, "_HOST_MARKERS", [])
    unmarked = R.SlotRing.create(2, 4096)
    assert nccl_rules.is_host_made(unmarked.payload(0, 16)) is None  # nothing registered: the ring marks nothing
    nccl_rules._register_host_marker()  # what install() does
    ring = R.SlotRing.create(2, 4096)
    for t in (ring.payload(0, 16), ring.typed_view(1, torch.float32, (2, 2)), ring.headers[0], ring.header_bytes[1]):
        assert nccl_rules.is_host_made(t) is not None
    dst = torch.empty(4)   # made by the test: a device tensor under nccl_rules
    with host_syncs.counting() as syncs:
        dst.copy_(ring.typed_view(0, torch.float32, (4,)))
    assert syncs.of_kind("blocking copy (copy_)") == 1, syncs.sites()
    with host_syncs.counting() as syncs:
        dst.copy_(ring.typed_view(0, torch.float32, (4,)), non_blocking=True)
    assert syncs.total == 0, syncs.sites()


# -- the schedule: no host sync, losses bit for bit -------------------------------------------------
N_MB, DIM, STEPS, WARMUP = 4, 16, 6, 2


def _train(rank, world, delegation, delayed):
    from torch.distributed.pipelining import PipelineStage

    from titan_ext.runtime import PipeMorph, inject_link_delays, remove_link_delays
    from titan_ext.testing import counted_sgd_step, mlp_stages, seeded_batch

    torch.manual_seed(0)
    mods = mlp_stages(world, DIM)
    inj = inject_link_delays("0:30") if delayed else None   # rank 0's messages arrive 30 ms late
    try:
        schedule = PipeMorph(PipelineStage(mods[rank], rank, world, torch.device("cpu")), N_MB,
                             loss_fn=Fn.mse_loss, adaptive=False, delegation=delegation)
        opt = torch.optim.SGD(mods[rank].parameters(), lr=0.05)
        steady, losses = [], []
        for k in range(STEPS):
            out, syncs = counted_sgd_step(schedule, opt, rank, world, *seeded_batch(k, 2 * N_MB, DIM))
            losses.append([float(v) for v in out])
            if k >= WARMUP:
                steady.append(syncs.sites())
    finally:
        if inj is not None:
            remove_link_delays()
    d = schedule.delegation
    stats = {"counts": dict(d.router.counts) if d is not None and d.router else None}
    if d is not None:
        d.close()
    params = [p.detach().clone() for p in mods[rank].parameters()]
    return steady, losses, params, stats


def _schedule_worker(rank, world):
    _, ref_losses, ref_params, _ = _train(rank, world, "off", delayed=True)
    steady, losses, params, stats = _train(rank, world, "always", delayed=True)
    return {"steady": steady, "equal": losses == ref_losses and all(torch.equal(a, b) for a, b in zip(params, ref_params)),
            "stats": stats}


@pytest.mark.slow  # 15 s, 2 ranks; delegated PipeMorph's 0 host syncs also in tests/runtime/test_host_runahead.py
def test_delegated_pipemorph_with_a_late_link_makes_no_host_sync_and_trains_bit_for_bit():
    """PipeMorph with ``delegation="always"`` under ``nccl_rules`` with rank 0's link 30 ms late (its
    messages are late for their consumers, and the receiver's early ones wait in their slots): no
    host-blocking call on the training thread in a steady iteration (ring tensors are counted as host
    tensors now), and the losses and parameters are those of the direct run, bit for bit."""
    from titan_ext.testing import run_ranks

    for rank, r in enumerate(run_ranks(_schedule_worker, 2, backend="nccl_rules", timeout_s=200)):
        assert r["steady"] == [[]] * (STEPS - WARMUP), (rank, r["steady"])
        assert r["equal"], rank
        assert r["stats"]["counts"] == {"direct": 0, "delegate": 2 * N_MB * STEPS}, (rank, r["stats"])
