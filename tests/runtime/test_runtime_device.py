"""The device layer on the asynchronous-device simulation (defect 2; ``testing/simdevice.py``).

Receives behave as on NCCL — ``wait()`` only enqueues a stream wait and returns, the data lands later,
``is_completed()`` is truthful — and a slow link is emulated at the receiver.  Checked on a 2-rank
PipeMorph run with +60 ms on the link:

* the estimator reads the link's delay within 10 % (arrival is stamped from the receive's completion,
  not from ``wait()``'s return, which would read ≈ 0);
* no stream wait sits earlier than its consumer and no consumer reads a receive before its wait
  (the simulated stream checks both on every kernel);
* compute times exclude link waits (the stall is booked as ``recv_wait_ms``, not as F/I/W).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.nn.functional as Fn
from torch.distributed.pipelining import PipelineStage

from titan_ext.runtime import PipeMorph
from titan_ext.runtime.execute.device import CpuDevice
from titan_ext.testing.simdevice import SimAsyncTransport, SimComputeStage, SimDevice, stream
from titan_ext.testing import run_ranks, step_rank

pytestmark = pytest.mark.timeout(240)

DIM, N_MB, STEPS, LINK_MS, COMPUTE_MS = 8, 4, 6, 60.0, 4.0


def _sim_worker(rank: int, world: int) -> dict:
    mod = SimComputeStage(DIM, COMPUTE_MS, COMPUTE_MS, COMPUTE_MS, seed=rank)
    sched = PipeMorph(PipelineStage(mod, rank, world, torch.device("cpu")), N_MB, loss_fn=Fn.mse_loss,
                      adaptive=False, backward="split", profile_every_max=1)  # a check every iteration: read each
    sched.executor.use_device(SimDevice(torch.device("cpu")))
    sched.executor.transport = SimAsyncTransport(sched.executor.transport, {0: LINK_MS})
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2 * N_MB, DIM, generator=g), torch.randn(2 * N_MB, DIM, generator=g)
    delays, records, recv_wait, losses = [], [], [], []
    for _ in range(STEPS):
        out: list = []
        step_rank(sched, rank, world, x, y, out)
        m = sched.last_metrics
        delays.append(m["link_delay_ms"][0])
        records.extend((r.start, r.end) for r in sched.last_timeline)
        recv_wait.append(m["recv_wait_ms"])
        losses.extend(float(v) for v in out)
    st = stream()
    return {"estimate": sched.last_metrics["link_delay_estimate_ms"][0], "delays": delays, "records": records, "recv_wait": recv_wait, "losses": losses,
            "stalls": list(st.stalls), "early": list(st.early_waits), "stale": list(st.stale_reads),
            "kernels": st.kernels}


@pytest.fixture(scope="module")
def sim_run() -> list[dict]:
    return run_ranks(_sim_worker, 2)


@pytest.mark.multiprocess
def test_estimator_reads_slow_link_on_async_device(sim_run):
    """+60 ms on the link: the estimator's window median, and the per-iteration estimates after the
    first (warm-up) iteration, at most 10 % low and 25 % high (a loaded host's scheduling latency only
    adds to a measured delay: 69 ms was seen with two 4-rank jobs sharing the 2 cores)."""
    for r in sim_run:
        assert 0.9 * LINK_MS <= r["estimate"] <= 1.25 * LINK_MS, (r["estimate"], r["delays"])
        assert 0.9 * LINK_MS <= statistics.median(r["delays"][1:]) <= 1.25 * LINK_MS, r["delays"]


@pytest.mark.multiprocess
def test_no_stream_wait_before_its_consumer(sim_run):
    for rank, r in enumerate(sim_run):
        assert r["kernels"] > 0
        assert r["early"] == [], (rank, r["early"][:3])
        assert r["stale"] == [], (rank, r["stale"][:3])
    losses = sim_run[1]["losses"]
    assert losses and all(v == v for v in losses), "a consumer read stale (NaN) data"


@pytest.mark.multiprocess
def test_compute_times_exclude_link_waits(sim_run):
    """No timed compute action contains a stall of the simulated stream (a link wait), and the stalls
    are booked as ``recv_wait_ms``: at least one link delay per iteration on the receiver."""
    for rank, r in enumerate(sim_run):
        long_stalls = [(a, b) for a, b in r["stalls"] if b - a > 1e-3]
        assert long_stalls, "the +60 ms link never stalled the stream"
        booked = [(a, b, s, e) for a, b in long_stalls for s, e in r["records"] if s < a and b < e]
        assert booked == [], (rank, [(1e3 * (e - s), 1e3 * (b - a)) for a, b, s, e in booked][:3])
    assert statistics.median(sim_run[1]["recv_wait"]) >= LINK_MS, sim_run[1]["recv_wait"]


class _LateWork:
    """NCCL semantics on a CPU: ``wait()`` returns at once, the data lands ``delay_s`` after posting."""

    def __init__(self, delay_s: float):
        self.lands_at, self.waited = time.perf_counter() + delay_s, False

    def wait(self, timeout=None):  # noqa: ARG002
        self.waited = True
        return True

    def is_completed(self):
        return time.perf_counter() >= self.lands_at


def test_cpu_device_waits_until_landed_under_nccl_semantics():
    """On CPU the host is the stream: under a backend whose wait() only enqueues (the NCCL-rules test
    backend), the consumer's wait still returns only once the data landed, so the next action's compute
    time cannot absorb the link wait; the arrival stamp is the landing."""
    layer = CpuDevice(torch.device("cpu"))
    layer.set_backend("nccl_rules")
    work = _LateWork(0.05)
    handle = layer.watch(0, [work])
    layer.wait_recv([handle])
    assert work.waited and time.perf_counter() >= work.lands_at
    assert handle.arrival_time() >= work.lands_at
    layer.close()


class _GlooWork:
    """Gloo semantics: ``wait()`` blocks until the data landed (``delay_s`` after posting); counted."""

    def __init__(self, delay_s: float):
        self.lands_at, self.waits = time.perf_counter() + delay_s, 0

    def wait(self, timeout=None):  # noqa: ARG002
        self.waits += 1
        time.sleep(max(0.0, self.lands_at - time.perf_counter()))
        return True

    def is_completed(self):
        return False  # gloo: not before someone waited


def test_a_consumer_stamped_receive_needs_no_watcher_and_stamps_within_its_bounds():
    """``watch(exact=False)`` where waits land the data (gloo): no watcher thread handles it; the
    consumer's one wait stamps it — the landing when the consumer waited for it, the consumer's own
    time (an upper bound) when the data was there first.  Where waits do not land the data (NCCL),
    ``exact=False`` changes nothing: the watcher stamps, the consumer's wait stays a stream wait."""
    layer = CpuDevice(torch.device("cpu"))
    layer.set_backend("gloo")
    queued: list = []
    layer.watcher.watch = lambda peer, handle: queued.append(handle) or handle
    early = _GlooWork(0.05)  # the consumer comes first and waits
    handle = layer.watch(0, [early], exact=False)
    t = time.perf_counter()
    layer.wait_recv([handle])
    assert queued == [] and early.waits == 1
    assert early.lands_at <= handle.arrival_time() <= time.perf_counter() and handle.arrival_time() >= t
    late = _GlooWork(0.0)  # the data is there first: the stamp is the consumer's, after the landing
    handle = layer.watch(0, [late], exact=False)
    time.sleep(0.02)
    layer.wait_recv([handle])
    layer.wait_recv([handle])  # a second wait does not wait on the work again (gloo's recv completes once)
    assert late.waits == 1 and handle.arrival_time() >= late.lands_at + 0.02
    layer.watch(0, [_GlooWork(0.0)])  # exact: the watcher's
    assert len(queued) == 1
    nccl = CpuDevice(torch.device("cpu"))
    nccl.set_backend("nccl_rules")
    work = _LateWork(0.02)
    handle = nccl.watch(0, [work], exact=False)
    nccl.wait_recv([handle])
    assert handle.arrival_time() >= work.lands_at and not handle.consumer_stamps
    for d in (layer, nccl):
        d.close()


def test_exact_arrivals_are_kept_where_the_deployed_plan_can_hide_a_delay():
    """``exact_arrival_links`` (the rule ``PipeMorph`` applies at every boundary, one stage per rank):
    the watcher stamps a link whose Eq. 1 tolerance exceeds the policy's absolute margin (1 ms) or whose
    plan was made for a delay beyond twice it; no tolerance yet: every link (several stages per rank:
    tests/runtime/test_layout_branches.py)."""
    from titan_ext.runtime.control.config import PolicySettings
    from titan_ext.runtime.decide.policy import exact_arrival_links

    margin = PolicySettings().abs_margin_ms
    assert margin == 1.0
    assert exact_arrival_links([0.1, 5.0, -0.2, float("nan")], None, margin) == {1, 3}
    assert exact_arrival_links([0.1, 0.0, 0.0], [0.0, 1.5, 3.0], margin) == {2}
    assert exact_arrival_links(None, None, margin) is None


def _watch_counting_worker(rank: int, world: int) -> list[dict]:
    from titan_ext.testing import SleepComputeStage

    mod = SleepComputeStage(16, 2.0, 2.0, 2.0, seed=rank)
    sched = PipeMorph(PipelineStage(mod, rank, world, torch.device("cpu")), 8, loss_fn=Fn.mse_loss)
    watcher, calls = sched.executor.device.watcher, [0]
    original = watcher.watch

    def counted(peer, handle):
        calls[0] += 1
        return original(peer, handle)

    watcher.watch = counted
    rows = []
    for k in range(26):
        before = calls[0]
        g = torch.Generator().manual_seed(k)
        step_rank(sched, rank, world, torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g))
        m = sched.last_metrics
        rows.append({"check": m["check"], "watched": calls[0] - before, "tolerance": m["eq1_tolerance_ms"]})
    return rows


@pytest.mark.multiprocess
def test_the_watcher_stamps_only_iterations_whose_profile_is_exchanged():
    """On gloo a receive the watcher stamps costs a thread hop before its consumer; the stamps are read only
    when the iteration's profile is exchanged, so an iteration with no exchange at its boundary posts no
    receive to the watcher, while exchanged ones still do on a link with slack (Eq. 1 tolerance > 1 ms)."""
    for rank, rows in enumerate(run_ranks(_watch_counting_worker, 2, backend="gloo")):
        unexchanged = [r["watched"] for r in rows[1:] if r["check"] in ("", "decided")]
        exchanged = [r["watched"] for r in rows[1:] if r["check"] in ("exchange", "posted")]
        assert len(unexchanged) >= 5 and not any(unexchanged), rows  # the period grew: iterations with none
        assert rows[-1]["tolerance"][0] > 1.0 and any(exchanged), rows
