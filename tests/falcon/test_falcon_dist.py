"""Falcon's torch.distributed parts on gloo / loopback: call hooks + ACF period on a real 2 DP x 2 PP
pipelining run, ring validation and GEMM probe, weighted gradient aggregation (float64), and
checkpoint-and-restart with a permuted mesh."""

import json
import os
import pickle
import statistics
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from titan_ext.runtime.falcon import (
    FalconMonitor,
    estimate_period,
    iteration_times_from_calls,
    locate_slow_devices,
    locate_slow_links,
    min_max_microbatch_split,
    plan_topology,
)
from titan_ext.testing import run_ranks

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- tiny 2-stage job


def _stage_module(stage: int, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(1234 + stage)
    if stage == 0:
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh()).to(dtype)
    return torch.nn.Sequential(torch.nn.Linear(16, 1)).to(dtype)


def _batch(step: int, dp: int, n_microbatches: int = 4, mb: int = 2):
    g = torch.Generator().manual_seed(10_000 * step + dp)
    x = torch.randn(n_microbatches * mb, 8, generator=g)
    y = torch.randn(n_microbatches * mb, 1, generator=g)
    return x, y


class _Job:
    """2-stage PP (torch.distributed.pipelining GPipe) x DP replicas with gradient all-reduce."""

    def __init__(self, grid, n_microbatches=4):
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        from titan_ext.runtime.falcon.restart import build_mesh_groups, stage_index_to_group_rank

        self.grid = grid
        self.mesh = build_mesh_groups(grid)
        self.num_pp = len(grid[0])
        self.stage_idx = self.mesh.pp_index
        self.model = _stage_module(self.stage_idx)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        mb = 2
        example = torch.zeros(mb, 8) if self.stage_idx == 0 else torch.zeros(mb, 16)
        self.stage = PipelineStage(self.model, self.stage_idx, self.num_pp, torch.device("cpu"),
                                   input_args=example, group=self.mesh.pp_group)
        self.stage.stage_index_to_group_rank = stage_index_to_group_rank(self.mesh.pp_ranks)
        self.sched = ScheduleGPipe(self.stage, n_microbatches,
                                   loss_fn=lambda out, tgt: torch.nn.functional.mse_loss(out, tgt))

    def step(self, step: int):
        x, y = _batch(step, self.mesh.dp_index)
        self.opt.zero_grad()
        losses = []
        if self.stage_idx == 0:
            self.sched.step(x)
        else:
            self.sched.step(target=y, losses=losses)
        for p in self.model.parameters():
            dist.all_reduce(p.grad, group=self.mesh.dp_group)
            p.grad /= len(self.grid)
        self.opt.step()
        return float(torch.stack(losses).detach().mean()) if losses else None


# --------------------------------------------------------------------------- ACF period on real calls


def _period_worker(rank, world, outdir, slow_from):
    from titan_ext.runtime.falcon.hooks import CallRecorder
    from titan_ext.runtime.falcon.restart import identity_grid

    rec = CallRecorder().start()
    job = _Job(identity_grid(2, 2))
    boundaries, walls = [], []
    for step in range(60):
        boundaries.append(len(rec.records))
        walls.append(time.perf_counter())
        # emulated compute: 15 ms per iteration; rank 3 (stage 1, replica 1) slows 6x from slow_from
        # (+75 ms a step: >= 3x the noise of a loaded 2-core host)
        time.sleep(0.090 if (rank == 3 and step >= slow_from) else 0.015)
        job.step(step)
    boundaries.append(len(rec.records))
    walls.append(time.perf_counter())
    rec.stop()
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump({"sig": rec.signatures(), "ts": rec.timestamps(), "boundaries": boundaries,
                     "walls": walls, "records": list(rec.records)}, f)


def test_acf_period_equals_true_period_on_real_gloo_calls_and_detects_slowdown(tmp_path):
    slow_from = 35
    run_ranks(_period_worker, 4, str(tmp_path), slow_from, backend="gloo")
    data = [pickle.load(open(tmp_path / f"rank{r}.pkl", "rb")) for r in range(4)]
    for r, rec in enumerate(data):
        # the hooks saw the pipeline's P2P traffic (outermost call only) and the DP all-reduces
        ops = {sig[0] for sig in rec["sig"]}
        assert "all_reduce" in ops and ops & {"isend", "irecv", "batch_isend_irecv"}
        groups = {sig[1] for sig in rec["sig"] if sig[0] == "all_reduce"}
        assert len(groups) == 1 and "world" not in groups  # one DP group per rank, not the world
        per_iter = np.diff(rec["boundaries"])
        true_period = int(per_iter[-1])
        assert (per_iter[1:] == true_period).all(), per_iter  # steady state: same calls every step
        assert true_period >= 3
        assert estimate_period(rec["sig"], 0.95) == true_period
        # iteration time from call timestamps == the loop's own iteration time
        anchor = rec["boundaries"][5]
        derived = iteration_times_from_calls(rec["ts"][anchor:], true_period)
        walls = np.diff(rec["walls"])[5 : 5 + len(derived)]
        assert np.median(np.abs(derived - walls) / walls) < 0.1
        assert abs(derived.sum() - walls.sum()) / walls.sum() < 0.05
    # Detection from call records alone (no trainer help), on every rank: rank 3's slowdown reaches
    # all ranks through the pipeline and the DP all-reduce.
    from types import SimpleNamespace

    for r in range(4):
        mon = FalconMonitor(recorder=SimpleNamespace(records=data[r]["records"]))
        out = mon.observe(None)
        assert mon._period == np.diff(data[r]["boundaries"])[-1]
        assert len(mon.detector.times) == len(data[r]["boundaries"]) - 2  # one per full period
        # The injected slowdown (iteration 35 on) is a verified upward change-point near 35; on a
        # shared host CPU contention can cause other (real) slowdowns too, so only this one is
        # asserted, plus the final state.
        ups = [c for c in mon.detector.change_points
               if c.kind in ("onset", "level") and c.relative_change >= 0.1]
        assert any(abs(c.index - slow_from) <= 2 for c in ups), mon.detector.change_points
        assert out["falcon/state"] == "slow"


# --------------------------------------------------------------------------- validation


def _validation_worker(rank, world, outdir):
    from titan_ext.runtime.falcon.validation import gemm_probe, validate_rings, validate_trees

    orig_mm = torch.mm
    orig_isend, orig_batch = dist.isend, dist.batch_isend_irecv
    if rank == 1:  # fault injection: device 1 computes 4x slower
        def slow_mm(a, b, *args, **kw):
            for _ in range(3):
                orig_mm(a, b)
            return orig_mm(a, b, *args, **kw)
        torch.mm = slow_mm
    # CallRecorder: one record per outermost call (batch_isend_irecv -> isend/irecv inside is not
    # recorded twice), with the tensor bytes
    from titan_ext.runtime.falcon.hooks import CallRecorder

    peer = rank ^ 1
    a, b = torch.ones(16), torch.zeros(16)
    with CallRecorder() as rec:
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, a, peer), dist.P2POp(dist.irecv, b, peer)]):
            w.wait()
        dist.all_reduce(a)
    hooked = [(r.op, r.group, r.nbytes) for r in rec.records]
    assert dist.isend is orig_isend and dist.batch_isend_irecv is orig_batch  # uninstalled
    if rank == 2:  # fault injection (test only): link 2 -> 3 is slow by 40 ms per message (validation's
        # messages are batched P2P ops on the rings' groups)
        def slow_batch(ops):
            if any(op.op is dist.isend and op.peer == 3 for op in ops):
                time.sleep(0.040)
            return orig_batch(ops)
        dist.batch_isend_irecv = slow_batch
    even = validate_rings([[0, 1, 2, 3]], nbytes=1 << 16, repeats=5)
    odd = validate_rings([[3, 2, 0]], nbytes=1 << 16, repeats=5)  # 3->2, 2->0, 0->3
    tree = validate_trees([[3, 2, 0, 1]], nbytes=1 << 16, repeats=5)  # root 3; 2->3, 0->3, 1->2
    gemm = gemm_probe(n=128, repeats=9)  # fastest of 9: descheduling only ever adds time
    dist.batch_isend_irecv, torch.mm = orig_batch, orig_mm
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump({"even": even, "odd": odd, "tree": tree, "gemm": gemm, "hooked": hooked}, f)


def test_ring_validation_pinpoints_slow_link_and_gemm_probe_slow_device(tmp_path):
    run_ranks(_validation_worker, 4, str(tmp_path), backend="gloo")
    res = [pickle.load(open(tmp_path / f"rank{r}.pkl", "rb")) for r in range(4)]
    for r in res:  # every rank has the same, complete view
        assert set(r["even"]) == {(0, 1), (1, 2), (2, 3), (3, 0)}
        assert set(r["odd"]) == {(3, 2), (2, 0), (0, 3)}
        assert set(r["tree"]) == {(2, 3), (0, 3), (1, 2)}
        assert set(r["gemm"]) == {0, 1, 2, 3}
        assert r["hooked"] == [("batch_isend_irecv", "world", 128), ("all_reduce", "world", 64)]
    even, odd, gemm = res[0]["even"], res[0]["odd"], res[0]["gemm"]
    # noise floor 10 ms: this host's 2 cores are shared with other jobs, so a healthy sub-ms transfer
    # can occasionally read a few ms (descheduling); the injected delay is 40 ms
    assert locate_slow_links(even, min_excess_s=0.010) == [(2, 3)]
    assert even[(2, 3)] > 0.035
    assert locate_slow_links(odd, min_excess_s=0.010) == []  # the slow link is not in this ring
    assert locate_slow_links(res[0]["tree"], min_excess_s=0.010) == [(2, 3)]  # tree passes (Fig. 9)
    # device 1 does 4x the work: compare with the median of its peers at a threshold sized to half
    # the injected effect (2x), not the detector's production 1.1x, which a busy host can cross
    peers = statistics.median(t for r, t in gemm.items() if r != 1)
    assert gemm[1] >= 2.0 * peers, gemm
    assert locate_slow_devices(gemm, ratio=2.0) == [1], gemm


# --------------------------------------------------------------------------- weighted aggregation


SPLITS = ([3, 1], [1, 3], [2, 2], [5, 2])


def _redistribute_worker(rank, world, outdir):
    for i, split in enumerate(SPLITS):
        _redistribute_one(rank, outdir, i, split)


def _redistribute_one(rank, outdir, i, split):
    from titan_ext.runtime.falcon.redistribute import (
        dp_weights,
        microbatch_ranges,
        weighted_all_reduce_gradients,
        weighted_all_reduce_loss,
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1)).double()
    g = torch.Generator().manual_seed(99)
    x = torch.randn(sum(split) * 3, 5, generator=g, dtype=torch.float64)
    y = torch.randn(sum(split) * 3, 1, generator=g, dtype=torch.float64)
    mine = microbatch_ranges(split)[rank]
    losses = [torch.nn.functional.mse_loss(model(x[3 * j : 3 * j + 3]), y[3 * j : 3 * j + 3]) for j in mine]
    local = torch.stack(losses).mean()
    local.backward()
    w = dp_weights(split)[rank]
    weighted_all_reduce_gradients(model.parameters(), w)
    loss = weighted_all_reduce_loss(local, w)
    with open(os.path.join(outdir, f"split{i}_rank{rank}.pkl"), "wb") as f:
        pickle.dump({"loss": loss.item(), "grads": [p.grad.clone() for p in model.parameters()]}, f)


def test_weighted_aggregation_equals_even_split_float64(tmp_path):
    run_ranks(_redistribute_worker, 2, str(tmp_path), backend="gloo")
    for i, split in enumerate(SPLITS):
        res = [pickle.load(open(tmp_path / f"split{i}_rank{r}.pkl", "rb")) for r in range(2)]
        _check_against_even_split(split, res)


def _check_against_even_split(split, res):
    # Reference: the even split's global loss = mean over all M micro-batches (= all samples), float64.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1)).double()
    g = torch.Generator().manual_seed(99)
    x = torch.randn(sum(split) * 3, 5, generator=g, dtype=torch.float64)
    y = torch.randn(sum(split) * 3, 1, generator=g, dtype=torch.float64)
    ref_loss = torch.nn.functional.mse_loss(model(x), y)
    ref_loss.backward()
    for r in res:
        assert r["loss"] == pytest.approx(ref_loss.item(), rel=1e-13, abs=0)
        for got, p in zip(r["grads"], model.parameters()):
            torch.testing.assert_close(got, p.grad, rtol=1e-12, atol=1e-15)


def test_redistribution_plan_feeds_a_valid_split():
    # 2 DP groups, replica 1 at 3x micro-batch time: Eq. (1) split used by the test above.
    assert min_max_microbatch_split(4, [1.0, 3.0]) == [3, 1]


# --------------------------------------------------------------------------- checkpoint-and-restart


def _train_worker(rank, world, ckdir, outdir, phase, steps, start_step, ckpt_after=None):
    from titan_ext.runtime.falcon.restart import (
        load_stage_checkpoint,
        read_restart_plan,
        save_stage_checkpoint,
    )

    grid = read_restart_plan(ckdir, 2, 2)
    job = _Job(grid)
    out = {"grid": grid, "role": (job.mesh.dp_index, job.mesh.pp_index)}
    if start_step > 0:
        st = load_stage_checkpoint(ckdir, job.stage_idx, job.model, job.opt)
        assert st["step"] == start_step
        out["loaded"] = {k: v.clone() for k, v in job.model.state_dict().items()}
        out["loaded_opt"] = pickle.dumps(job.opt.state_dict())
    losses = []
    for s in range(start_step, start_step + steps):
        losses.append(job.step(s))
        if ckpt_after is not None and s + 1 == ckpt_after:
            out["at_ckpt"] = {k: v.clone() for k, v in job.model.state_dict().items()}
            out["at_ckpt_opt"] = pickle.dumps(job.opt.state_dict())
            if job.mesh.dp_index == 0:
                save_stage_checkpoint(ckdir, job.stage_idx, job.model, job.opt, step=ckpt_after)
            dist.barrier()
    out["losses"] = losses
    out["final"] = {k: v.clone() for k, v in job.model.state_dict().items()}
    out["final_opt"] = pickle.dumps(job.opt.state_dict())
    with open(os.path.join(outdir, f"{phase}_rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)


def test_2dp_2pp_restart_with_permuted_mesh_resumes_identically(tmp_path):
    from titan_ext.runtime.falcon.restart import identity_grid, write_restart_plan

    ck, out = tmp_path / "ck", tmp_path / "out"
    ck.mkdir()
    out.mkdir()
    # Uninterrupted reference run on the identity mesh [[0, 1], [2, 3]] (DP groups {0,2}, {1,3}):
    # 6 steps, checkpoint of every stage after step 3.
    run_ranks(_train_worker, 4, str(ck), str(out), "ref", 6, 0, 3, backend="gloo")
    ref = [pickle.load(open(out / f"ref_rank{r}.pkl", "rb")) for r in range(4)]
    # Link 0-2 (inside the DP group of stage 0) is slow: plan a permutation, restart with it
    # from the step-3 checkpoint, train steps 3..5.
    plan = plan_topology(identity_grid(2, 2), [(0, 2)])
    grid = [list(r) for r in plan.grid]
    pos = {r: (d, s) for d, row in enumerate(grid) for s, r in enumerate(row)}
    assert pos[0][0] == pos[2][0] and abs(pos[0][1] - pos[2][1]) == 1  # now a PP hop
    write_restart_plan(str(ck), grid, reason="dp_link 0-2")
    run_ranks(_train_worker, 4, str(ck), str(out), "after", 3, 3, backend="gloo")
    after = [pickle.load(open(out / f"after_rank{r}.pkl", "rb")) for r in range(4)]
    assert all(a["grid"] == grid for a in after) and grid != identity_grid(2, 2)
    moved = 0
    for r in range(4):
        d, s = after[r]["role"]
        assert (d, s) == pos[r]
        prev_holder = identity_grid(2, 2)[d][s]
        moved += prev_holder != r
        # the rank that now holds role (d, s) starts from exactly the state that role had at the
        # checkpoint (model and optimizer, bit for bit)
        for k, v in after[r]["loaded"].items():
            assert torch.equal(v, ref[prev_holder]["at_ckpt"][k])
        got_opt = pickle.loads(after[r]["loaded_opt"])["state"]
        want_opt = pickle.loads(ref[prev_holder]["at_ckpt_opt"])["state"]
        for key in want_opt:
            assert torch.equal(got_opt[key]["momentum_buffer"], want_opt[key]["momentum_buffer"])
        # resumed training == the uninterrupted run, role by role
        for k, v in after[r]["final"].items():
            torch.testing.assert_close(v, ref[prev_holder]["final"][k], rtol=1e-6, atol=1e-7)
        if after[r]["losses"][0] is not None:
            np.testing.assert_allclose(after[r]["losses"], ref[prev_holder]["losses"][3:], rtol=1e-6)
    assert moved == plan.moved == 2


# --------------------------------------------------------------------------- closed loop


class _SlowableStage(torch.nn.Module):
    """A stage whose forward takes `per_microbatch_s` of (emulated) device time per micro-batch."""

    def __init__(self, inner, per_microbatch_s):
        super().__init__()
        self.inner = inner
        self.per_microbatch_s = per_microbatch_s

    def forward(self, x):
        time.sleep(self.per_microbatch_s[0])
        return self.inner(x)


def _closed_loop_worker(rank, world, outdir, slow_from):
    """2 DP x 2 PP GPipe job + FalconMonitor on every rank, fed the max iteration time over ranks.
    Rank 3's device becomes 30x slower at `slow_from`; the loop runs validation when told to and
    applies micro-batch redistribution (Eq. 1 split + weighted gradient aggregation)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from titan_ext.runtime.falcon import BOCDConfig, FalconConfig, FalconMonitor, StrategyCosts
    from titan_ext.runtime.falcon.redistribute import dp_weights, weighted_all_reduce_gradients
    from titan_ext.runtime.falcon.restart import (
        build_mesh_groups,
        identity_grid,
        stage_index_to_group_rank,
    )
    from titan_ext.runtime.falcon.validation import gemm_probe

    grid = identity_grid(2, 2)
    mesh = build_mesh_groups(grid)
    delay = [0.005]
    model = _SlowableStage(_stage_module(mesh.pp_index), delay)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    total_mb = 8
    costs = StrategyCosts(microbatch_redistribution=0.05, topology_adjustment=1e6, checkpoint_restart=1e9)
    # Verification (§4.2) at 50 % instead of 10 %: the injected change is > 5x the healthy step, while
    # two busy loops on the 2 cores shift a ~0.1 s step by tens of % for a few iterations, which at
    # 10 % made a host slowdown the onset and the injected one a mere level change
    mon = FalconMonitor(FalconConfig(costs=costs, num_microbatches=total_mb,
                                     detector=BOCDConfig(min_relative_change=0.5)), grid=grid)

    def make_schedule(n_mb):
        example = torch.zeros(2, 8) if mesh.pp_index == 0 else torch.zeros(2, 16)
        stage = PipelineStage(model, mesh.pp_index, 2, torch.device("cpu"), input_args=example,
                              group=mesh.pp_group)
        stage.stage_index_to_group_rank = stage_index_to_group_rank(mesh.pp_ranks)
        return ScheduleGPipe(stage, n_mb, loss_fn=lambda o, t: torch.nn.functional.mse_loss(o, t))

    split = [total_mb // 2, total_mb // 2]
    sched = make_schedule(split[mesh.dp_index])
    orig_mm = torch.mm
    log = []
    for step in range(45):
        if step == slow_from and rank == 3:
            # the device slows down 30x (+580 ms a step, >= 3x a loaded host's step noise; at 12x the
            # measured S2 effect fell to 0.16 once under load 25, as per-step overheads dominated) ...
            delay[0] = 0.150
            torch.mm = lambda a, b, _mm=orig_mm: [_mm(a, b) for _ in range(4)][-1]  # ... GEMMs too
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(total_mb * 2, 8, generator=g), torch.randn(total_mb * 2, 1, generator=g)
        lo = 2 * sum(split[: mesh.dp_index])
        hi = lo + 2 * split[mesh.dp_index]
        opt.zero_grad()
        if mesh.pp_index == 0:
            sched.step(x[lo:hi])
        else:
            sched.step(target=y[lo:hi], losses=[])
        weighted_all_reduce_gradients(model.parameters(), dp_weights(split)[mesh.dp_index], mesh.dp_group)
        opt.step()
        it = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(it, op=dist.ReduceOp.MAX)  # identical input on every rank
        out = mon.observe(float(it))
        if out.get("falcon/validate"):
            out = out.with_metrics(mon.report_validation(gemm_times_s=gemm_probe(n=128, repeats=5)))
        if "microbatch_redistribution" in out.get("falcon/apply", ""):
            split = json.loads(out["falcon/plan/microbatch_split"])
            sched = make_schedule(split[mesh.dp_index])
        out = {k: v for k, v in out.items() if k != "falcon/detector_us"}  # the only rank-dependent entry
        log.append(out)
    torch.mm = orig_mm
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(log, f)


def test_closed_loop_detects_slow_device_redistributes_and_measures_effect(tmp_path):
    slow_from = 15
    run_ranks(_closed_loop_worker, 4, str(tmp_path), slow_from, backend="gloo")
    logs = [pickle.load(open(tmp_path / f"rank{r}.pkl", "rb")) for r in range(4)]
    # every rank took the same decisions at the same iterations
    keys = ("falcon/event", "falcon/apply", "falcon/root_cause", "falcon/plan/microbatch_split")
    for r in range(1, 4):
        assert [{k: o.get(k) for k in keys} for o in logs[r]] == [{k: o.get(k) for k in keys} for o in logs[0]]
    log = logs[0]
    # event-based: the onset that follows the injection (detected after it, its change point at it)
    ups = [(i, o) for i, o in enumerate(log) if o.get("falcon/event") == "onset" and i >= slow_from]
    times = [round(o["falcon/iteration_time_s"], 3) for o in log]
    assert ups and ups[0][1]["falcon/change_point_iteration"] >= slow_from - 2, times
    onset = ups[0][1]
    # the 30× slower device is named first (on a loaded 2-core host a second rank's probe may also
    # cross the 1.1× threshold; the slowest one comes first)
    assert onset["falcon/slow_devices"].split(",")[0] == "3" and onset["falcon/root_cause"] == "compute"
    red = next(o for o in log if "microbatch_redistribution" in o.get("falcon/apply", ""))
    split = json.loads(red["falcon/plan/microbatch_split"])
    assert sum(split) == 8 and split[1] < split[0]  # replica 1 holds the slow device
    eff = next(o for o in log if "falcon/effect/microbatch_redistribution" in o)
    # measured effect: iterations after the redistribution are clearly faster than before it
    assert eff["falcon/effect/microbatch_redistribution"] > 0.2, eff
