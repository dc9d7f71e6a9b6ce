"""Host run-ahead: on a GPU the host must stay ahead of the device.

The device here is :mod:`titan_ext.testing.lagdevice`: a device thread executes what the host enqueued a
fixed lag later, so a call that waits for the device costs that lag and is counted by call site, and a
device call from a thread that never selected the rank's device is reported (on a GPU: a context on
GPU 0).  Three parts:

* the simulated device itself against CUDA's rules (events complete late, ``synchronize`` blocks,
  ``elapsed_time`` refuses incomplete events and is float32, a device per thread);
* the device layer's event timer on it: no host sync in a steady iteration, and a clock that never
  runs late (the anchor stamp is a lower bound);
* every schedule on two ranks under the ``nccl_rules`` backend with the job's PP timeouts installed, as
  a TorchTitan job has them: **0 host-blocking calls in a steady non-exchange iteration**, the device
  still behind the host at every iteration's end, and no device call from a thread without the device.
  (TorchTitan itself, 4 ranks, PipeMorph with delegation and PipeMorph with Falcon in DP x PP:
  ``test_titan_job_runs_ahead`` in the slow tier.)
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as Fn

from titan_ext.testing import host_syncs
from titan_ext.testing import counted_sgd_step, mlp_stages, run_ranks, seeded_batch

pytestmark = pytest.mark.timeout(300)

LAG_MS = 60.0


@pytest.fixture
def lag():
    from titan_ext.testing import lagdevice

    dev = lagdevice.install(lag_ms=LAG_MS, index=1)
    try:
        yield dev
    finally:
        lagdevice.uninstall()


# -- the simulated device against CUDA's rules --------------------------------------------------------
def test_events_complete_a_lag_after_their_record_and_synchronize_blocks_and_is_counted(lag):
    from titan_ext.testing.lagdevice import LagEvent

    with lag.guard():
        a, b = LagEvent(lag), LagEvent(lag)
        t0 = time.perf_counter()
        a.record()
        time.sleep(0.01)
        b.record()
        assert not a.query() and not b.query()  # the device has not reached them
        with pytest.raises(RuntimeError, match="not ready"):
            a.elapsed_time(b)  # cudaErrorNotReady
        with host_syncs.counting() as syncs:
            b.synchronize()
        waited = time.perf_counter() - t0
        assert a.query() and b.query()
        span = a.elapsed_time(b)
    assert waited >= LAG_MS / 1e3  # the host waited for the device
    assert isinstance(span, float) and span == float(torch.tensor(span, dtype=torch.float32))
    assert 5.0 <= span < 200.0
    assert syncs.of_kind("Event.synchronize") == 1
    ((_, site),) = syncs.by_site
    assert site.startswith("tests/runtime/test_host_runahead.py:") or "test_host_runahead.py:" in site, site


def test_a_device_call_from_a_thread_that_never_selected_the_device_is_reported(lag):
    from titan_ext.runtime.execute.device import thread_device
    from titan_ext.testing.lagdevice import LagEvent

    ev = LagEvent(lag)
    with lag.guard():
        ev.record()
        guard = thread_device()  # the training thread's device, for a side thread

    def bare():
        ev.query()

    def guarded():
        with guard():
            ev.query()

    for fn in (bare, guarded):
        t = threading.Thread(target=fn, name=f"side-{fn.__name__}")
        t.start()
        t.join()
    assert len(lag.violations) == 1, lag.violations
    assert "Event.query" in lag.violations[0] and "side-bare" in lag.violations[0]
    assert "no device selected" in lag.violations[0]


def test_a_read_of_a_device_tensor_waits_for_the_device(lag, monkeypatch):
    """A read (``.item()``) drains the compute stream: the host loses its lead."""
    from titan_ext.testing.lagdevice import LagEvent

    monkeypatch.setattr(host_syncs, "is_device_tensor", lambda t: isinstance(t, torch.Tensor))
    with lag.guard():
        LagEvent(lag).record()
        t0 = time.perf_counter()
        with host_syncs.counting() as syncs:
            torch.ones(3).sum().item()
        waited = time.perf_counter() - t0
    assert waited >= 0.8 * LAG_MS / 1e3 and not lag.behind()
    assert syncs.of_kind("item()") == 1


# -- the device layer's timer on it ---------------------------------------------------------------------
def test_steady_iterations_make_no_host_sync_and_are_resolved_later(lag):
    """The host runs ahead: each iteration ends before the device ran it.  Today's main resolved the
    previous iteration with ``Event.synchronize`` at every iteration's start (one host sync a step)."""
    from titan_ext.runtime.execute.device import device_layer

    layer = device_layer("cpu")
    timer = layer.timer()
    recs = []
    with layer.context(), host_syncs.counting() as syncs:
        for _ in range(5):
            timer.begin_iteration()
            rec = type("Rec", (), {"start": math.nan, "end": math.nan})()
            token = timer.start(rec)
            time.sleep(0.004)
            timer.stop(rec, token)
            timer.end_iteration()
            recs.append(rec)
            assert not timer.resolve(block=False)  # the device is behind
            assert lag.behind()
    assert syncs.total == 0, syncs.sites()
    time.sleep(2 * LAG_MS / 1e3)
    with layer.context():
        assert timer.resolve(block=False)  # the device caught up: every iteration resolved, no wait
    assert timer.blocking_resolves == 0
    for rec in recs:
        assert 3.0 <= 1e3 * (rec.end - rec.start) < 60.0, (rec.start, rec.end)


def test_the_clock_never_runs_late_after_a_delayed_stamp(lag, monkeypatch):
    """An anchor's host stamp is read before its record call: a host thread delayed right after the
    call (GC, preemption) does not move it.  Today's main stamped after the call and took
    ``max(stamp, chained)`` from then on: one 40 ms delay made every later time 40 ms late."""
    from titan_ext.runtime.execute import device as device_mod
    from titan_ext.testing.lagdevice import LagEvent

    layer = device_mod.device_layer("cpu")
    timer = layer.timer()
    real_record = LagEvent.record
    delayed = {"n": 0}

    def record(self, stream=None):
        real_record(self, stream)
        if stream is not None and stream.name == "anchor" and delayed["n"] == 1:
            time.sleep(0.04)  # the host thread stalls right after this anchor's record call
        if stream is not None and stream.name == "anchor":
            delayed["n"] += 1

    monkeypatch.setattr(LagEvent, "record", record)
    errors = []
    with layer.context():
        for _ in range(4):
            timer.begin_iteration()
            marks: list[float] = []
            timer.mark(marks)
            ev = timer._pending[-1][2]  # the mark's event
            timer.end_iteration()
            assert timer.resolve(block=True)
            errors.append(1e3 * (marks[0] - ev.t))  # mapped time − the device's own time (ms)
    assert delayed["n"] >= 3
    assert all(-2.0 < e < 2.0 for e in errors), errors


# -- every schedule on two ranks, NCCL's rules, the job's PP timeouts ------------------------------------
N_MB, DIM, STEPS = 4, 16, 8
SCHEDULES = ("pipemorph", "crosspipe", "pipemorph+delegation", "torch-1f1b")


def _make(name: str, stage):
    from torch.distributed.pipelining import Schedule1F1B

    from titan_ext.runtime import CrossPipe, PipeMorph

    if name == "pipemorph":
        return PipeMorph(stage, N_MB, loss_fn=Fn.mse_loss, profile_every=3, profile_every_max=3)
    if name == "crosspipe":
        return CrossPipe(stage, N_MB, loss_fn=Fn.mse_loss, profile_every=3, profile_every_max=3)
    if name == "pipemorph+delegation":
        return PipeMorph(stage, N_MB, delegation="always", loss_fn=Fn.mse_loss, profile_every=3,
                         profile_every_max=3)
    return Schedule1F1B(stage, N_MB, loss_fn=Fn.mse_loss)


def _train(rank: int, world: int, name: str, dev) -> list[dict]:
    from torch.distributed.pipelining import PipelineStage

    mods = mlp_stages(world, DIM)
    schedule = _make(name, PipelineStage(mods[rank], rank, world, torch.device("cpu")))
    opt = torch.optim.SGD(mods[rank].parameters(), lr=0.05)
    steps = []
    for k in range(STEPS):
        x, y = seeded_batch(k, 2 * N_MB, DIM)
        cadence = getattr(schedule, "cadence", None)
        exchanged = cadence is not None and cadence.due(schedule.iteration)
        seen = len(dev.violations)
        out, syncs = counted_sgd_step(schedule, opt, rank, world, x, y)
        behind = dev.behind()
        steps.append({"exchanged": exchanged, "syncs": syncs.sites(), "behind": behind,
                      "violations": dev.violations[seen:], "loss": sum(float(v) for v in out)})
    if getattr(schedule, "delegation", None) is not None:
        schedule.delegation.close()
    return steps


def _runahead_worker(rank: int, world: int) -> dict:
    from titan_ext.runtime.comm import timeouts
    from titan_ext.testing import lagdevice

    dev = lagdevice.install(lag_ms=LAG_MS)
    # as every TorchTitan job installs them (titan/registry.py): PP waits watched by a side thread
    timeouts.install_p2p_timeout()
    timeouts.set_timeout(60.0)
    out = {name: _train(rank, world, name, dev) for name in SCHEDULES}
    time.sleep(0.6)  # the watch thread polls every 0.25 s
    out["late_violations"] = list(dev.violations)
    return out


@pytest.fixture(scope="module")
def runahead() -> list[dict]:
    return run_ranks(_runahead_worker, 2, backend="nccl_rules", timeout_s=280)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", SCHEDULES)
def test_no_host_blocking_call_in_a_steady_non_exchange_iteration(runahead, name):
    for rank in (0, 1):
        steps = runahead[rank][name][2:]  # 0..1: start-up (shape inference, the first plan)
        steady = [s for s in steps if not s["exchanged"]]
        assert steady, (rank, name, steps)
        assert [s["syncs"] for s in steady] == [[]] * len(steady), (rank, name, steady)
        assert all(s["behind"] for s in steady), (rank, name, [s["behind"] for s in steps])
        assert all(math.isfinite(s["loss"]) for s in runahead[rank][name])
        # an exchange waits only on the device layer's newest event (the documented one)
        for s in steps:
            for line in s["syncs"]:
                assert "Event.synchronize at titan_ext/runtime/execute/device.py" in line, (rank, name, s)


@pytest.mark.multiprocess
def test_no_device_call_from_a_thread_without_the_device(runahead):
    for rank in (0, 1):
        assert runahead[rank]["late_violations"] == [], (rank, runahead[rank]["late_violations"])


# -- TorchTitan itself (slow tier) --------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]


TITAN_JOBS = {  # name: (config, extra arguments); CrossPipe and torch's 1F1B run in the two-rank test above
    "PipeMorph+delegation": ("debug_cpu.toml", ["--titan_ext.delegation", "always"]),
    "PipeMorph+Falcon (DP 2 x PP 2)": ("debug_cpu_dp2_pp2.toml", []),
}


#: TorchTitan's own per-step host sync in a job with data parallelism: its ``train_step`` counts the
#: global batch's valid tokens with ``dist_utils.dist_sum(...)`` (an all-reduce and ``.item()``) before
#: the forward, every step, whatever the schedule — upstream's, not titan_ext's
TORCHTITAN_TOKEN_COUNT = "at torchtitan/distributed/utils.py"


@pytest.mark.slow
@pytest.mark.parametrize("job", [  # delegated run-ahead in CI: tests/runtime/test_delegate_runahead.py (80 s here)
    pytest.param(j, marks=pytest.mark.soak) if "delegation" in j else j for j in TITAN_JOBS])
def test_titan_job_runs_ahead(job, tmp_path):
    """TorchTitan's debug model, 4 ranks, ``nccl_rules`` + the lagging device (the CPU shim installs it
    under ``TITAN_EXT_TEST_DEVICE=lag``): after start-up, host-blocking calls only in logging steps
    (TorchTitan's ``should_log``: step 1 and every 4th) and at exchanges (the device layer's one wait on
    the newest event), besides TorchTitan's own global token count in a job with DP (every step,
    :data:`TORCHTITAN_TOKEN_COUNT`); no device call from a thread without the device on any rank.
    (Whether the device is still behind at a step's end is asserted by the two-rank test: without per-op
    kernels the simulated device has nothing of the optimizer's to run, so here it catches up during it.)"""
    from titan_ext.testing.launch import torchrun

    config, extra = TITAN_JOBS[job]
    report = tmp_path / "report"
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", TITAN_EXT_TEST_BACKEND="nccl_rules",
               TITAN_EXT_TEST_DEVICE="lag", TITAN_EXT_LAG_REPORT=str(report), TITAN_EXT_LAG_MS=str(LAG_MS))
    log = tmp_path / "train.log"
    p = torchrun(4, ["-m", "titan_ext.train", "--job.config_file", f"train_configs/{config}", "--training.steps",
                     "8", "--metrics.log_freq", "4", "--job.dump_folder", str(tmp_path / "dump"), *extra],
                 log=log, cwd=ROOT, env=env, timeout=600, local_ranks_filter=0)
    assert p.returncode == 0, log.read_text()[-3000:]
    for rank in range(4):
        lines = [json.loads(x) for x in (report / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [x["violations"] for x in lines] == [[]] * len(lines), (rank, lines)
        # a line: the previous step's logging (after its optimizer step), then this step; steps 1-2 are
        # start-up (shape inference, the first plan; TorchTitan's switch to the train timeout)
        quiet = [x for x in lines[2:] if not (x["step"] - 1 == 1 or (x["step"] - 1) % 4 == 0)]
        assert quiet, (rank, lines)
        for x in quiet:
            ours = [s for s in x["syncs"] if TORCHTITAN_TOKEN_COUNT not in s]
            assert all("Event.synchronize at titan_ext/runtime/execute/device.py" in s for s in ours), (rank, x)
