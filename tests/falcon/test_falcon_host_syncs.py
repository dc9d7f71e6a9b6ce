"""Falcon's DP x PP job makes no host sync in a steady step and creates no NCCL communicator
mid-training.

* A steady step of :class:`~titan_ext.titan.falcon_job.FalconJob` (4 ranks, DP 2 x PP 2, under the
  ``nccl_rules`` backend): no host sync on the training thread
  (:func:`titan_ext.testing.host_syncs.counting`); the steps' numbers are exchanged only at the checks
  (every ``falcon_check_every`` steps and the last step; before: two world-sized all-reduces a step,
  then one), one recursive-doubling MAX on the gloo control group each, no other collective there;
  every rank feeds the detector every step, the same steps in order, at the check after it.
* The recursive-doubling exchange (3 ranks: the fold of a rank beyond a power of two) is the exact
  MAX, and feeds the detector what the per-step ring exchange fed, a lagging rank included.
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

import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from titan_ext.testing import run_ranks

from _falcon_trainer import chunks, fake_trainer, mesh_of_groups, step_runner, wrap_dist

pytestmark = pytest.mark.timeout(300)

STEPS, STEADY_FROM = 7, 2  # step 0: S2's cost measured by a real exchange; step 1: the ACF recorder starts
EVERY = 4  # TitanExt's default falcon_check_every: checks at steps 3 (index) and 6 (the last step)
CHECKS = [EVERY - 1, STEPS - 1]


# --------------------------------------------------------------------------- the job, 4 ranks
def _install_recorder(calls: list, phase: list) -> None:
    """Wrap torch.distributed's entry points: (phase, name, group, async_op).  ``isend``/``irecv`` stay
    unwrapped (a ``P2POp`` checks their identity); a bare pair has a blocking ``send`` or ``recv`` on
    one side in the code this guards (before: validation's ``dist.send`` + ``dist.irecv``)."""
    names = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier", "send", "recv",
             "batch_isend_irecv")
    wrap_dist(names, lambda name, group, args, kwargs: calls.append(
        (phase[0], name, group, bool(kwargs.get("async_op", False)))))


def _job_worker(rank: int, world: int, outdir: str) -> dict:
    from titan_ext.testing import host_syncs
    from titan_ext.runtime.falcon.device_clock import is_control_group
    from titan_ext.titan.config import TitanExt
    from titan_ext.titan import falcon_job as falcon_job
    from titan_ext.runtime.falcon import measure
    from titan_ext.titan.falcon_job import FalconJob
    from titan_ext.runtime.falcon.measure import validate

    mesh = mesh_of_groups(rank)
    calls, phase = [], ["startup"]
    _install_recorder(calls, phase)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    trainer = fake_trainer(mesh, model, outdir, steps=STEPS)
    job = FalconJob(trainer, TitanExt(falcon=True, falcon_apply=True))
    assert job.check_every == EVERY and job.last_step == STEPS
    # the exchange's reductions: (phase, group kind) of each (bare isend/irecv are not wrapped above)
    reductions, reduce = [], measure.max_all_reduce

    def counted(vec, group, ranks=None):
        reductions.append((phase[0], "control" if is_control_group(group) else "other", list(ranks or [])))
        return reduce(vec, group, ranks)

    measure.max_all_reduce = counted
    # a loaded host's noise can look like an onset to the detector on this toy job's millisecond
    # steps; the step that validates then (§4.3) syncs and runs collectives by design, and is no
    # steady step: recorded, and left out below
    validated, job_validate = [], falcon_job.validate
    falcon_job.validate = lambda *a, **k: (validated.append(phase[0]), job_validate(*a, **k))[1]
    fed = []
    falcon = job._falcon
    job._falcon = lambda obs, step: (fed.append((step.index, obs.iteration_time_s, phase[0])), falcon(obs, step))[1]
    stale, record_stale = [], job._record_stale
    job._record_stale = lambda obs, step: (stale.append((step.index, phase[0])), record_stale(obs, step))[1]

    run_step = step_runner(model, job)
    syncs = []
    for step in range(STEPS):
        trainer.step = step + 1
        phase[0] = step
        model.zero_grad()
        with host_syncs.counting() as counted:
            job.train_step(run_step, iter(chunks(job.dp_index, step, 3)))
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
    measure.max_all_reduce = reduce
    return {"syncs": syncs, "fed": fed, "validated": validated, "reductions": reductions,
            "stale": stale, "calls": [(p, n, kind(g), a) for p, n, g, a in calls]}


@pytest.fixture(scope="module")
def job_run(tmp_path_factory) -> list[dict]:
    return run_ranks(_job_worker, 4, str(tmp_path_factory.mktemp("job")), backend="nccl_rules", timeout_s=240)


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


@pytest.mark.multiprocess
def test_a_steady_falcon_step_makes_no_host_sync(job_run):
    steady_steps = _steady_steps(job_run)
    for rank, r in enumerate(job_run):
        steady = [_steady_syncs(r["syncs"][s]) for s in steady_steps]
        assert steady == [[]] * len(steady_steps), (rank, steady_steps, r["syncs"])


@pytest.mark.multiprocess
def test_the_steps_are_exchanged_only_at_the_checks_by_one_reduction_on_the_control_group(job_run):
    """Before: ``DPSync.transfer_times`` and ``measure_step`` each all-reduced over the world every
    step, then one all-reduce a step. Now one recursive-doubling reduction at each check (every
    ``falcon_check_every`` steps and the last step), pairing a pipeline's ranks first, and no
    collective at all on the control groups in a steady step."""
    steady_steps = _steady_steps(job_run)
    for rank, r in enumerate(job_run):
        assert r["reductions"] == [(c, "control", [0, 2, 1, 3]) for c in CHECKS], (rank, r["reductions"])
        for step in steady_steps:
            mine = [(n, a) for p, n, k, a in r["calls"] if p == step and k == "control"]
            assert mine == [], (rank, step, mine)


@pytest.mark.multiprocess
def test_every_rank_feeds_the_detector_every_step_in_order_at_the_check_after_it(job_run):
    fed = [r["fed"] for r in job_run]
    assert all(f == fed[0] for f in fed), fed
    assert all(r["stale"] == job_run[0]["stale"] for r in job_run)
    # on CPU a step's device time is known at its end: every step is handled at the first check after
    # it — fed, or (only after a change that a noise-triggered validation applied) recorded as stale
    handled = sorted([(i, c) for i, _, c in fed[0]] + job_run[0]["stale"])
    assert handled == [(i, next(c for c in CHECKS if c >= i)) for i in range(STEPS)], handled
    assert job_run[0]["stale"] == [] or job_run[0]["validated"], job_run[0]["stale"]
    assert all(t > 0 for _, t, _ in fed[0])


@pytest.mark.multiprocess
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


# --------------------------------------------------------------------------- the exchange itself
def _exchange_worker(rank: int, world: int) -> dict:
    from titan_ext.runtime.falcon.device_clock import control_group
    from titan_ext.runtime.falcon.exchange import max_all_reduce
    from titan_ext.runtime.falcon.measure import ObservationExchange, StepRecord

    control = control_group()
    # the reduction alone: random vectors, the group's order and a permuted one
    vectors = []
    for it, order in enumerate((None, [2, 0, 1])):
        torch.manual_seed(10 * it + rank)
        vec = torch.randn(5, 7, dtype=torch.float64)
        vectors.append(max_all_reduce(vec, control, order).clone())
    # the job's exchange: a per-step ring (before) against a check every 4 steps (after), one DP x PP
    # grid of 3 replicas x 1 stage; rank 1 reads each step 2 steps late (a device behind its host)
    before = ObservationExchange(control, 1, 3, every=1, window=6, algorithm="ring")
    after = ObservationExchange(control, 1, 3, every=4)
    after.order([[0], [1], [2]])
    fed = {"before": [], "after": []}
    lag, steps, loops = (2 if rank == 1 else 0), 14, 16  # every rank runs the same boundaries
    for k in range(loops):
        for name, ex in (("before", before), ("after", after)):
            if k < steps:
                ex.add(StepRecord(k, object()))  # not read yet
            j = k - lag
            if 0 <= j < steps:
                step = ex._mine[j]
                step.timer, step.seconds = None, 0.1 + 0.01 * ((5 * j + 3 * rank) % 7)
                step.at = {"step_start": float(j), "dp_start": j + 0.05 + 0.001 * rank, "dp_end": j + 0.07}
                step.host = {"split": [2, 2, 2], "dp_index": rank, "pp_index": 0, "link_delay_ms": {},
                             "trainer_step": j + 1}
            if name == "before" or k % 4 == 3 or k == loops - 1:
                fed[name] += [(s.index, obs.iteration_time_s, obs.replica_microbatch_s,
                               tuple(sorted(obs.per_group_times.items()))) for s, obs, _ in ex.exchange()]
    return {"vectors": vectors, "fed": fed, "reductions": (before.reductions, after.reductions)}


@pytest.mark.multiprocess
def test_the_recursive_doubling_exchange_feeds_what_the_per_step_ring_fed():
    """3 ranks (one beyond a power of two: folded in and out): the reduction is the exact element-wise
    MAX of every rank's vector, whatever the pairing order; and the job's exchange at a check every 4
    steps feeds the detector the same steps, in the same order, with the same numbers as the per-step
    gloo all-reduce did — a rank that reads its steps 2 steps late included."""
    world = 3
    results = run_ranks(_exchange_worker, world, backend="gloo", timeout_s=240)
    for it in range(2):
        expected = torch.stack([(torch.manual_seed(10 * it + r), torch.randn(5, 7, dtype=torch.float64))[1]
                                for r in range(world)]).amax(0)
        for r in results:
            assert torch.equal(r["vectors"][it], expected)
    fed = results[0]["fed"]
    assert all(r["fed"] == fed for r in results[1:])
    assert [i for i, *_ in fed["after"]] == list(range(14))
    assert fed["after"] == fed["before"]
    # the slowest rank's time for every step (the MAX over ranks), the replicas' compute phases
    for i, t, replica_s, _ in fed["after"]:
        assert t == max(0.1 + 0.01 * ((5 * i + 3 * r) % 7) for r in range(world))
        assert replica_s == pytest.approx(tuple((0.05 + 0.001 * r) / 2 for r in range(world)))
    assert results[0]["reductions"] == (16, 4)  # before: every step (and the lag's 2); after: 4 checks


# --------------------------------------------------------------------------- fake CUDA components
KERNEL_MS, HOST_MS = 40.0, 0.5


def test_step_clock_reads_each_steps_device_time_once_complete_without_waiting(monkeypatch):
    """Steps of 3 x 40 ms kernels enqueued in 1.5 ms (the device behind the host, a 200 ms backlog
    before the second one): each step's device time is read once the device ran it — a step or more
    later — with no ``Event.synchronize``; before, ``stop_s`` waited on the step's last event."""
    from _fake_cuda import FakeGPU, install

    from titan_ext.testing import host_syncs
    from titan_ext.runtime.falcon.measure import StepClock

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

    from titan_ext.runtime.falcon.measure import StepClock

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

    from titan_ext.testing import host_syncs
    from titan_ext.titan import falcon_dp as dp_mod
    from titan_ext.runtime.falcon.measure import StepClock

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
    from _allocations import NewStorageBytes

    from titan_ext.runtime.falcon.redistribute import weighted_all_reduce_gradients

    shapes = [(300, 200), (7,), (5, 3), (64,), (4, 4)]
    dtypes = [torch.float32, torch.float32, torch.float32, torch.float64, torch.float32]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=d)) for s, d in zip(shapes, dtypes)]
    for p, g in zip(params, _grads(rank)):
        p.grad = g
    weight = (rank + 1) / (world * (world + 1) / 2)
    big = params[0].numel() * 4
    with NewStorageBytes([p.grad for p in params if p.grad is not None] + list(params)) as counted:
        weighted_all_reduce_gradients(params, weight, bucket_bytes=big)  # the big one alone, in place
    # a model of small gradients only: 24 of 1000 floats in buckets of 2 (8 kB): 12 buckets, of which
    # at most BUCKETS_IN_FLIGHT are flattened at once
    small = [torch.nn.Parameter(torch.zeros(1000)) for _ in range(24)]
    for k, p in enumerate(small):
        p.grad = torch.full((1000,), float(rank + k))
    with _LiveFlatBytes() as flats:
        weighted_all_reduce_gradients(small, 1.0, bucket_bytes=8000)
    return {"grads": [p.grad.clone() for p in params], "new_bytes": counted.bytes, "big": big,
            "small": [float(p.grad[0]) for p in small] + [float(p.grad[-1]) for p in small],
            "flats": (flats.count, flats.peak)}


class _LiveFlatBytes(TorchDispatchMode):
    """Bytes of the ``torch.cat`` results alive at once (the flattened buckets): the peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.count = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.cat.default:
            nbytes = out.numel() * out.element_size()
            self.live, self.count = self.live + nbytes, self.count + 1
            self.peak = max(self.peak, self.live)
            weakref.finalize(out, self._freed, nbytes)
        return out


@pytest.mark.multiprocess
def test_weighted_gradient_aggregation_is_the_exact_weighted_sum_without_a_flat_copy():
    from titan_ext.runtime.falcon.redistribute import BUCKETS_IN_FLIGHT

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
    # small gradients only: the exact sums, through 12 buckets of which at most two are held at once by
    # the function (before: every bucket flattened before the first was waited for, a copy of the whole
    # gradient, 12 x 8000 bytes); one more may be seen alive while gloo's finished work still holds its
    # tensor (a C++ reference keeps the Python tensor alive until the backend lets go)
    sums = [float(sum(r + k for r in range(world))) for k in range(24)]
    for r in results:
        assert r["small"] == sums + sums
        count, peak = r["flats"]
        assert count == 12 and peak <= (BUCKETS_IN_FLIGHT + 1) * 8000 < 12 * 8000 / 2, r["flats"]


# --------------------------------------------------------------------------- steps fed after a change
class _Clock:  # a device that returns each step two steps after the host ended it
    def __init__(self):
        self.ended = []

    def stop(self):
        from titan_ext.runtime.falcon.measure import StepRecord

        step = StepRecord(len(self.ended), None)
        self.ended.append(step)
        return step

    def read(self):
        return []


class _Exchange:  # every rank has read the steps up to ``behind`` behind the newest
    def __init__(self, behind=2):
        self.steps, self.fed, self.behind, self.calls = [], 0, behind, []

    def add(self, step):
        self.steps.append(step)

    def exchange(self):
        self.calls.append(len(self.steps) - 1)  # the newest step's index: where the check ran
        out = [(s, SimpleNamespace(index=s.index, iteration_time_s=0.1), [])
               for s in self.steps[self.fed:len(self.steps) - self.behind]]
        self.fed += len(out)
        return out


def _stub_job(falcon, schedule=None, every=1, last_step=None, behind=2):
    """FalconJob's step boundary (:meth:`FalconJob._after_step`) over stubs: the clock and exchange
    above, ``falcon(obs, step)`` for the monitor and its decisions, checks every ``every`` steps
    and at ``last_step``; the rows it records in ``job.rows``."""
    from titan_ext.titan.falcon_job import FalconJob

    job = FalconJob.__new__(FalconJob)
    job.step_clock, job.exchange = _Clock(), _Exchange(behind)
    job.trainer = SimpleNamespace(pp_schedule=schedule, step=0)
    job.costs = SimpleNamespace(measure_replan=lambda rt: None)
    job.dp = SimpleNamespace(step_read=lambda s: None, absorb=lambda r: None)
    job.split, job.dp_index, job.pp_index, job._version, job.stale_steps = [3, 3], 0, 0, 0, 0
    job.grid, job.check_every, job.last_step, job._steps = [[0, 2], [1, 3]], every, last_step, 0
    job.rows = []
    job.log = SimpleNamespace(record=lambda decision, rows, step=None: job.rows.append((step, decision)))
    job._link_delay_ms = {}
    job._falcon = falcon
    return job


def _run_steps(job, n):
    """n training steps' boundaries (what :meth:`FalconJob.train_step` does around them)."""
    for k in range(n):
        job.trainer.step = k + 1
        job._after_step()
        job._steps += 1


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
    _run_steps(job, 8)
    # steps 0..5 came back; the change was applied at the end of step 4 (when step 2 was fed), so
    # steps 3 and 4 (started before it) are not fed, step 5 is
    assert fed == [0, 1, 2, 5], fed
    assert job.stale_steps == 2
    assert [s.host["split"] for s in job.step_clock.ended[:6]] == [[3, 3]] * 5 + [[4, 2]]
    # the steps not fed are recorded under their own steps (training steps 4 and 5), with the split
    # in force when they were handled, as every row records it
    assert [(step, d["falcon/stale"], d["falcon/split"]) for step, d in job.rows] == [(4, 1, "[4, 2]"),
                                                                                       (5, 1, "[4, 2]")]


def test_the_exchange_runs_only_at_the_check_cadence_and_every_step_is_fed_in_order():
    """``falcon_check_every`` = 3 over 10 steps, a device 1 step behind (a step is read at the next
    step's end): the exchange runs at steps 3, 6, 9 and the last one (10, which reads every step:
    training ends) — 4 exchanges where a per-step exchange made 10 — and the monitor is fed every
    step once, in order, each at the first check that had it."""
    fed = []
    job = _stub_job(lambda obs, step: fed.append((step.index, job.trainer.step)), every=3, last_step=10,
                    behind=1)
    # at the last step the clock is drained (waiting for the device): every step is read
    job.step_clock.drain = lambda: (setattr(job.exchange, "behind", 0), [])[1]
    _run_steps(job, 10)
    assert job.exchange.calls == [2, 5, 8, 9], job.exchange.calls
    assert [i for i, _ in fed] == list(range(10)), fed
    assert fed == [(0, 3), (1, 3), (2, 6), (3, 6), (4, 6), (5, 9), (6, 9), (7, 9), (8, 10), (9, 10)], fed
    assert job.stale_steps == 0 and job.rows == []


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
    from titan_ext.runtime import PipeMorph
    from titan_ext.runtime.control.cadence import CheckCadence
    from titan_ext.runtime.control.extensions import Extensions

    falcon = SimpleNamespace(every_iteration=True)  # Falcon's observer: it needs every iteration
    cadence = CheckCadence(1, 4, 1, 0.1, 1.0)
    cadence.fixed()
    schedule = SimpleNamespace(extensions=Extensions(observers=[falcon], falcon_observer=falcon), cadence=cadence,
                               config=SimpleNamespace(profile_every=1, profile_every_max=4))
    PipeMorph.falcon.fset(schedule, None)
    assert cadence.profile_every_max == 4
    checks = []
    for it in range(40):
        if cadence.due(it):
            checks.append(it)
            cadence.after_check(it, True, [1.0])
    assert len(checks) < 20, checks


def test_the_check_cadence_knob_is_validated():
    from titan_ext.titan.config import TitanExt, TitanExtConfigError, validate_titan_ext

    assert TitanExt().falcon_check_every == EVERY
    validate_titan_ext(TitanExt(falcon_check_every=1))
    for bad in (0, -3):
        with pytest.raises(TitanExtConfigError, match="falcon_check_every"):
            validate_titan_ext(TitanExt(falcon_check_every=bad))
