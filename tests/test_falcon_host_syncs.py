"""Falcon's DP x PP job makes no host sync in a steady step and creates no NCCL communicator
mid-training.

* A steady step of :class:`~titan_ext.titan.falcon.job.FalconJob` (4 ranks, DP 2 x PP 2, under the
  ``nccl_rules`` backend): no host sync on the training thread
  (:func:`titan_ext.runtime.host_syncs.counting`), one all-reduce of host data on the gloo control
  group (before: two world-sized all-reduces a step); every rank feeds the detector the same steps,
  in order, each at its own end on the CPU.
* Validation (Falcon §4.3) runs batched P2P ops on the rings' own PP / DP groups, made at start-up —
  no bare ``send``/``recv`` (a two-rank NCCL communicator made at the moment of diagnosis); S3's
  default-group communicator is made at start-up by every rank.
* On the fake CUDA of ``tests/_fake_cuda.py`` (a device behind the host): :class:`StepClock` and
  :class:`DPSync` read their device times once complete, without ``Event.synchronize``.
* ``weighted_all_reduce_gradients``: the exact weighted average of an independent reference,
  allocating at most a bucket (before: two full flat copies of the gradients).
* The schedule's check cadence is adaptive again once the job takes Falcon off it, and the job holds
  PipeMorph's link readings between its checks.
"""

from __future__ import annotations

import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from titan_ext.testing import run_ranks

pytestmark = pytest.mark.timeout(300)

STEPS, STEADY_FROM = 7, 2  # step 0: S2's cost measured by a real exchange; step 1: the ACF recorder starts


# --------------------------------------------------------------------------- the job, 4 ranks
def _install_recorder(calls: list, phase: list) -> None:
    """Wrap torch.distributed's entry points: (phase, name, group, async_op).  ``isend``/``irecv`` stay
    unwrapped (a ``P2POp`` checks their identity); a bare pair has a blocking ``send`` or ``recv`` on
    one side in the code this guards (before: validation's ``dist.send`` + ``dist.irecv``)."""
    names = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier", "send", "recv",
             "batch_isend_irecv")
    for name in names:
        original = getattr(dist, name)

        def wrapped(*args, _name=name, _original=original, **kwargs):
            group = kwargs.get("group")
            if _name == "batch_isend_irecv":
                group = args[0][0].group
            elif _name in ("send", "recv") and len(args) > 2:
                group = args[2]
            calls.append((phase[0], _name, group, bool(kwargs.get("async_op", False))))
            return _original(*args, **kwargs)

        setattr(dist, name, wrapped)


def _job_worker(rank: int, world: int, outdir: str) -> dict:
    from test_falcon_groups import _chunks, _mesh_of_groups

    from titan_ext.runtime import host_syncs
    from titan_ext.runtime.falcon.device_clock import is_control_group
    from titan_ext.titan.config import TitanExt
    from titan_ext.titan.falcon import job as falcon_job
    from titan_ext.titan.falcon.job import FalconJob
    from titan_ext.titan.falcon.measure import validate

    mesh = _mesh_of_groups(rank)
    calls, phase = [], ["startup"]
    _install_recorder(calls, phase)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    trainer = SimpleNamespace(
        parallel_dims=SimpleNamespace(get_mesh=lambda name: mesh[name]), gradient_accumulation_steps=3,
        model_parts=[model], optimizers=SimpleNamespace(optimizers=[torch.optim.AdamW(model.parameters())]),
        pp_schedule=SimpleNamespace(falcon=None), device=torch.device("cpu"),
        job_config=SimpleNamespace(job=SimpleNamespace(dump_folder=outdir)),
        config=SimpleNamespace(dump_folder=outdir), step=1)
    job = FalconJob(trainer, TitanExt(falcon=True, falcon_apply=True))
    # a loaded host's noise can look like an onset to the detector on this toy job's millisecond
    # steps; the step that validates then (§4.3) syncs and runs collectives by design, and is no
    # steady step: recorded, and left out below
    validated, job_validate = [], falcon_job.validate
    falcon_job.validate = lambda *a, **k: (validated.append(phase[0]), job_validate(*a, **k))[1]
    fed = []
    falcon = job._falcon
    job._falcon = lambda obs, step: (fed.append((step.index, obs.iteration_time_s)), falcon(obs, step))

    def run_step(chunks):
        for inputs, labels in chunks:
            torch.nn.functional.mse_loss(model(inputs["input"]), labels, reduction="sum").backward()
            job.after_backward()

    syncs = []
    for step in range(STEPS):
        trainer.step = step + 1
        phase[0] = step
        model.zero_grad()
        with host_syncs.counting() as counted:
            job.train_step(run_step, iter(_chunks(job.dp_index, step, 3)))
        syncs.append(counted.sites())
    phase[0] = "validate"
    validate(job.monitor, grid=job.grid, emulation=job.emulation, control=job.control, device=job.device,
             ring_groups=job.ring_groups())

    def kind(group):
        if is_control_group(group):
            return "control"
        if group is None or group is dist.group.WORLD:
            return "world"
        if group is job.pp_group:
            return "pp"
        if group is job.dp_group:
            return "dp"
        return "other"

    falcon_job.validate = job_validate
    return {"syncs": syncs, "fed": fed, "validated": validated,
            "calls": [(p, n, kind(g), a) for p, n, g, a in calls]}


@pytest.fixture(scope="module")
def job_run() -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        return run_ranks(_job_worker, 4, d, backend="nccl_rules", timeout_s=240)


#: nccl_rules records *every* collective's ``wait()`` as a "barrier
#: (device synchronize)"; on ProcessGroupNCCL an all-reduce's ``wait()`` only makes the current stream
#: wait.  The DP gradient sum's waits are therefore not counted here (only that kind, only that file).
_COLLECTIVE_WAIT = ("barrier (device synchronize)", "titan_ext/runtime/falcon/redistribute.py:")


def _steady_syncs(sites: list[str]) -> list[str]:
    return [s for s in sites if not (_COLLECTIVE_WAIT[0] in s and _COLLECTIVE_WAIT[1] in s)]


def _steady_steps(job_run) -> list[int]:
    """The steps from ``STEADY_FROM`` in which no rank validated (validation is collective: all or
    none); at least three, or the test has no power."""
    validated = set(job_run[0]["validated"])
    assert all(set(r["validated"]) == validated for r in job_run), [r["validated"] for r in job_run]
    steady = [s for s in range(STEADY_FROM, STEPS) if s not in validated]
    assert len(steady) >= 3, validated
    return steady


def test_a_steady_falcon_step_makes_no_host_sync(job_run):
    steady_steps = _steady_steps(job_run)
    for rank, r in enumerate(job_run):
        steady = [_steady_syncs(r["syncs"][s]) for s in steady_steps]
        assert steady == [[]] * len(steady_steps), (rank, steady_steps, r["syncs"])


def test_a_steady_falcon_step_makes_one_collective_on_the_control_groups(job_run):
    """Before: ``DPSync.transfer_times`` and ``measure_step`` each all-reduced over the world every
    step. Now one all-reduce of host data a step (no device work waits on it)."""
    steady_steps = _steady_steps(job_run)
    for rank, r in enumerate(job_run):
        for step in steady_steps:
            mine = [(n, a) for p, n, k, a in r["calls"] if p == step and k == "control"]
            assert mine == [("all_reduce", False)], (rank, step, mine)


def test_every_rank_feeds_the_detector_the_same_steps_in_order(job_run):
    fed = [r["fed"] for r in job_run]
    assert all(f == fed[0] for f in fed), fed
    indices = [i for i, _ in fed[0]]
    # on CPU a step's device time is known at its end: every step is fed at its own end
    assert indices == list(range(STEPS)), indices
    assert all(t > 0 for _, t in fed[0])


def test_validation_uses_the_rings_groups_made_at_start_up_never_a_bare_p2p_op(job_run):
    for rank, r in enumerate(job_run):
        startup = {(n, k) for p, n, k, _ in r["calls"] if p == "startup"}
        # the communicators validation (pp, dp) and S3's state move (world) use exist from start-up:
        # every member ran a collective on them there
        assert {("all_reduce", "pp"), ("all_reduce", "dp"), ("all_reduce", "world")} <= startup, startup
        during = [(n, k) for p, n, k, _ in r["calls"] if p == "validate"]
        assert not [c for c in during if c[0] in ("send", "recv")], during
        batched = {k for n, k in during if n == "batch_isend_irecv"}
        assert batched == {"pp", "dp"}, during  # each ring on its own group, none on the world
        assert not [c for c in during if c[0] == "all_reduce" and c[1] != "control"], during


# --------------------------------------------------------------------------- fake CUDA components
KERNEL_MS, HOST_MS = 40.0, 0.5


def test_step_clock_reads_each_steps_device_time_once_complete_without_waiting(monkeypatch):
    """Steps of 3 x 40 ms kernels enqueued in 1.5 ms (the device behind the host, a 200 ms backlog
    before the second one): each step's device time is read once the device ran it — a step or more
    later — with no ``Event.synchronize``; before, ``stop_s`` waited on the step's last event."""
    from _fake_cuda import FakeGPU, install

    from titan_ext.runtime import host_syncs
    from titan_ext.titan.falcon.measure import StepClock

    gpu = FakeGPU(index=0)
    install(monkeypatch, gpu)
    with torch.cuda.device(torch.device("cuda", 0)):
        clock = StepClock(torch.device("cuda", 0))  # start-up: primes its timers
        gpu.host_work(1e3)
        per_step = []
        with host_syncs.counting() as syncs:
            for index, backlog_ms in enumerate((0.0, 200.0, 0.0, 0.0, 0.0)):
                gpu.kernel(backlog_ms)
                clock.start(index)
                for _ in range(3):
                    gpu.kernel(KERNEL_MS)
                    gpu.host_work(HOST_MS)
                clock.stop()
                per_step.append([s.index for s in clock.read()])
                gpu.host_work(200.0)  # the host's work between steps: the device catches up meanwhile
            gpu.host_work(1e3)
            per_step.append([s.index for s in clock.read()])
        done = [i for r in per_step for i in r]
    assert syncs.total == 0, syncs.sites()
    assert per_step[0] == [], "a step is not read before the device ran it"
    assert done == list(range(5)), per_step
    assert any(len(r) > 1 or (r and r[0] < i) for i, r in enumerate(per_step)), per_step  # read later
    assert clock.forced_reads == 0


def test_step_clock_times_match_the_device(monkeypatch):
    from _fake_cuda import FakeGPU, install

    from titan_ext.titan.falcon.measure import StepClock

    gpu = FakeGPU(index=0)
    install(monkeypatch, gpu)
    with torch.cuda.device(torch.device("cuda", 0)):
        clock = StepClock(torch.device("cuda", 0))
        steps = []
        for index, backlog_ms in enumerate((0.0, 200.0)):
            gpu.kernel(backlog_ms)
            steps.append(clock.start(index))
            clock.mark("a")
            for _ in range(3):
                gpu.kernel(KERNEL_MS)
                gpu.host_work(HOST_MS)
            clock.mark("b")
            clock.stop()
        gpu.host_work(1e3)
        assert [s.index for s in clock.read()] == [0, 1]
    for s in steps:
        assert s.seconds == pytest.approx(3 * KERNEL_MS / 1e3, abs=1e-5)
        assert s.span_s("a", "b") == pytest.approx(3 * KERNEL_MS / 1e3, abs=1e-5)


def test_dp_sync_times_come_from_the_steps_marks_without_a_host_sync(monkeypatch):
    """DPSync's compute phase and sync time are device times of marks on the step's clock, read with
    the step; before, ``transfer_times`` called ``Event.synchronize`` on its marks every step."""
    from _fake_cuda import FakeGPU, install

    from titan_ext.runtime import host_syncs
    from titan_ext.titan.falcon import dp as dp_mod
    from titan_ext.titan.falcon.measure import StepClock

    gpu = FakeGPU(index=0)
    install(monkeypatch, gpu)
    monkeypatch.setattr(dp_mod, "weighted_all_reduce_gradients", lambda *a, **k: gpu.kernel(25.0))
    dev = torch.device("cuda", 0)
    with torch.cuda.device(dev):
        clock = StepClock(dev)
        sync = dp_mod.DPSync(SimpleNamespace(model_parts=[]), SimpleNamespace(collective_delay_s=lambda *a: 0.0),
                             None, dev, clock=clock)
        sync.stage_bytes, sync.pp_index, sync.dp_ranks, sync.dp_group, sync.base_s = [0.0], 0, [0, 1], None, 0.0
        with host_syncs.counting() as syncs:
            clock.start(0)
            sync.step_started()
            gpu.kernel(70.0)  # the chunks' forwards and backwards
            sync.sync()
            clock.stop()
            gpu.host_work(1e3)
            for step in clock.read():
                sync.step_read(step)
    assert syncs.total == 0, syncs.sites()
    assert sync.compute_s == pytest.approx(0.070, abs=1e-5) and sync.sync_s == pytest.approx(0.025, abs=1e-5)


# --------------------------------------------------------------------------- weighted all-reduce
def _grads(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(300, 200, generator=g), torch.randn(7, generator=g), torch.randn(5, 3, generator=g),
            torch.randn(64, generator=g, dtype=torch.float64), None]


def _weighted_worker(rank: int, world: int) -> dict:
    from test_falcon_on_gpu import _NewStorageBytes

    from titan_ext.runtime.falcon.redistribute import weighted_all_reduce_gradients

    shapes = [(300, 200), (7,), (5, 3), (64,), (4, 4)]
    dtypes = [torch.float32, torch.float32, torch.float32, torch.float64, torch.float32]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=d)) for s, d in zip(shapes, dtypes)]
    for p, g in zip(params, _grads(rank)):
        p.grad = g
    weight = (rank + 1) / (world * (world + 1) / 2)
    big = params[0].numel() * 4
    with _NewStorageBytes([p.grad for p in params if p.grad is not None] + list(params)) as counted:
        weighted_all_reduce_gradients(params, weight, bucket_bytes=big)  # the big one alone, in place
    return {"grads": [p.grad.clone() for p in params], "new_bytes": counted.bytes, "big": big}


def test_weighted_gradient_aggregation_is_the_exact_weighted_sum_without_a_flat_copy():
    world = 3
    results = run_ranks(_weighted_worker, world, backend="gloo", timeout_s=120)
    weights = [(r + 1) / (world * (world + 1) / 2) for r in range(world)]
    reference = []
    for k, shape in enumerate([(300, 200), (7,), (5, 3), (64,), (4, 4)]):
        terms = [_grads(r)[k] for r in range(world)]
        ref = sum((w * t if t is not None else torch.zeros(shape)) for w, t in zip(weights, terms))
        reference.append(ref)
    for r in results:
        for got, ref in zip(r["grads"], reference):
            assert got.dtype == (torch.float64 if got.numel() == 64 else torch.float32)
            torch.testing.assert_close(got, ref.to(got.dtype), rtol=1e-6, atol=1e-7)
        # no copy of the big gradient: what it allocated is the missing gradient and the small
        # ones' bucket (before: two flat copies of all gradients, > 2 x 240 kB)
        assert r["new_bytes"] < r["big"] // 4, r["new_bytes"]
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(r["grads"], results[0]["grads"]))


# --------------------------------------------------------------------------- steps fed after a change
class _Clock:  # a device that returns each step two steps after the host ended it
    def __init__(self):
        self.ended = []

    def stop(self):
        from titan_ext.titan.falcon.measure import StepRecord

        step = StepRecord(len(self.ended), None)
        self.ended.append(step)
        return step

    def read(self):
        return []


class _Exchange:  # every rank has read the steps up to two behind the newest
    def __init__(self):
        self.steps, self.fed = [], 0

    def add(self, step):
        self.steps.append(step)

    def exchange(self):
        out = [(s, SimpleNamespace(index=s.index), []) for s in self.steps[self.fed:len(self.steps) - 2]]
        self.fed += len(out)
        return out


def _stub_job(falcon, schedule=None):
    """FalconJob's step boundary (:meth:`FalconJob._after_step`) over stubs: the clock and exchange
    above, ``falcon(obs, step)`` for the monitor and its decisions."""
    from titan_ext.titan.falcon.job import FalconJob

    job = FalconJob.__new__(FalconJob)
    job.step_clock, job.exchange = _Clock(), _Exchange()
    job.trainer = SimpleNamespace(pp_schedule=schedule, step=0)
    job.costs = SimpleNamespace(measure_replan=lambda rt: None)
    job.dp = SimpleNamespace(step_read=lambda s: None, absorb=lambda r: None)
    job.split, job.dp_index, job.pp_index, job._version, job.stale_steps = [3, 3], 0, 0, 0, 0
    job._link_delay_ms = {}
    job._falcon = falcon
    return job


def test_a_step_started_before_an_applied_change_is_not_fed():
    """A device two steps behind the host: steps come back two steps late. A decision on step 2
    changes the split; steps 3 and 4 ran before that change (their numbers describe the old split) and
    are not fed, step 5 (run under the new split) is — the monitor compares steps of one configuration."""
    fed = []

    def falcon(obs, step):
        fed.append(step.index)
        if step.index == 2:  # a decision: S2's split from the next step on (FalconJob.apply bumps the version)
            job.split, job._version = [4, 2], job._version + 1

    job = _stub_job(falcon)
    for k in range(8):
        job.trainer.step = k + 1
        job._after_step()
    # steps 0..5 came back; the change was applied at the end of step 4 (when step 2 was fed), so
    # steps 3 and 4 (started before it) are not fed, step 5 is
    assert fed == [0, 1, 2, 5], fed
    assert job.stale_steps == 2
    assert [s.host["split"] for s in job.step_clock.ended[:6]] == [[3, 3]] * 5 + [[4, 2]]


def test_the_job_holds_pipemorphs_link_readings_between_its_checks():
    """With Falcon off the schedule its checks grow apart (below): a step without a check carries the
    last check's PP link readings, not none (which the exchange would read as healthy links)."""
    checks = {0: {0: 5.0}, 3: {0: 60.0}}  # step -> the schedule's readings at that step's check
    schedule = SimpleNamespace(last_metrics={})
    job = _stub_job(lambda obs, step: None, schedule)
    for k in range(6):
        schedule.last_metrics = {"link_delay_ms": checks[k]} if k in checks else {}
        job._after_step()
    assert [s.host["link_delay_ms"] for s in job.step_clock.ended] == [{0: 5.0}] * 3 + [{0: 60.0}] * 3


# --------------------------------------------------------------------------- the check cadence
def test_the_check_cadence_is_adaptive_again_when_the_job_takes_falcon_off():
    """PipeMorph fixes its check period while its own Falcon observer needs every iteration; when
    FalconJob takes Falcon off the schedule (``schedule.falcon = None``), the period may grow again
    (PipeMorph §6 ②), so most steady steps are non-exchange ones."""
    from titan_ext.runtime.cadence import CheckCadence
    from titan_ext.runtime.pipemorph import PipeMorph

    observers = [SimpleNamespace(every_iteration=True)]

    class _Extensions:
        every_iteration = property(lambda self: any(o.every_iteration for o in observers))

        def drop_falcon(self):
            observers.clear()

    cadence = CheckCadence(1, 4, 1, 0.1, 1.0)
    cadence.fixed()
    schedule = SimpleNamespace(extensions=_Extensions(), cadence=cadence,
                               config=SimpleNamespace(profile_every=1, profile_every_max=4))
    PipeMorph.falcon.fset(schedule, None)
    assert cadence.profile_every_max == 4
    checks = []
    for it in range(40):
        if cadence.due(it):
            checks.append(it)
            cadence.after_check(it, True, [1.0])
    assert len(checks) < 20, checks
