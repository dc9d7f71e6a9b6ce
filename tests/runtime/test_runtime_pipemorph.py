"""PipeMorph runtime on gloo/loopback: numerical equivalence with torch's ScheduleGPipe under a plan
swap every iteration, validated deployment (a bad plan is rejected and training goes on), swaps only at
iteration boundaries, and rank agreement on plans when local measurements differ."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as Fn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from titan_ext.plan.builtin import builtin_plan
from titan_ext.plan import PipelineProfile
from titan_ext.runtime import Decision, PipeMorph, ReplanPolicy
from titan_ext.runtime.control.deploy import plan_hash
from titan_ext.testing import gpipe_reference, mlp_stages, run_ranks, seeded_batch, step_rank

# In the default tier: the core runtime contract (GPipe equivalence, agreement, control plane), ~1 min.
pytestmark = pytest.mark.timeout(300)

DIM = 8
BATCH = 16


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return seeded_batch(1000 + step, BATCH, DIM)


def _step(sched, rank: int, world: int, step: int) -> list[float]:
    x, y = _batch(step)
    losses: list = []
    step_rank(sched, rank, world, x, y, losses)
    return [float(v.detach()) for v in losses]


class CyclePolicy:
    """Forces a different plan at every check: planner-made plans with varying warm-up counts and
    torch's own built-in plans (full-backward 1F1B and GPipe), in turn."""

    window = 1
    forces = True

    def __init__(self, world: int, n_mb: int):
        self.k = 0
        self.cycle: list[Decision] = [
            Decision("force", "x=S..1", warmup_counts=[world - i for i in range(world)]),
            Decision("force", "torch 1F1B", actions=builtin_plan("1F1B", world, n_mb)[0]),
            Decision("force", "x=2(S-i)-1", warmup_counts=[2 * (world - i) - 1 for i in range(world)]),
            Decision("force", "torch GPipe", actions=builtin_plan("GPipe", world, n_mb)[0]),
            Decision("force", "x=N..", warmup_counts=[n_mb - i for i in range(world)]),
        ]

    def decide(self, estimate, deployed_counts, initial_counts, since, slack_floor=2):
        d = self.cycle[self.k % len(self.cycle)]
        self.k += 1
        return d


def _equivalence_worker(rank: int, world: int, n_mb: int, steps: int):
    ref_losses, ref_params = gpipe_reference(rank, world, n_mb, steps, lambda s, k: _step(s, rank, world, k), DIM)
    mods = mlp_stages(world, DIM)
    sched = PipeMorph(PipelineStage(mods[rank], rank, world, torch.device("cpu")), n_mb, loss_fn=Fn.mse_loss,
                      policy=CyclePolicy(world, n_mb))
    opt = torch.optim.SGD(mods[rank].parameters(), lr=0.05)
    losses, hashes, versions, executed = [], [], [], []
    for k in range(steps):
        hashes.append(sched.deployed.hash)
        versions.append(sched.plan_version)
        opt.zero_grad()
        losses.append(_step(sched, rank, world, k))
        opt.step()
        executed.append(sorted((r.kind, r.stage, r.microbatch) for r in sched.last_timeline))
    return {
        "ref_losses": ref_losses, "losses": losses,
        "ref_params": ref_params,
        "params": [p.detach().clone() for p in mods[rank].parameters()],
        "hashes": hashes, "versions": versions, "executed": executed,
        "log": list(sched.decision_log),
    }


@pytest.mark.multiprocess
def test_equivalence_with_gpipe_under_a_new_plan_every_iteration():
    # Re-planning is asynchronous (planned during iteration k+1, swapped at its end), so the first
    # forced plan runs in iteration 2; from iteration 1 on every boundary swaps in a new plan:
    # 9 steps = 8 consecutive iterations each running a different plan, iterations 2-8 running the
    # policy's 5 plans in turn and back to the first two (every swap between two of them, wrap included).
    world, n_mb, steps = 4, 8, 9
    results = run_ranks(_equivalence_worker, world, n_mb, steps)
    for rank, res in enumerate(results):
        # a different plan ran in every iteration from the second on, and all ranks ran the same one
        assert res["versions"][:2] == [1, 1] and len(set(res["versions"][1:])) == steps - 1, res["versions"]
        assert all(a != b for a, b in zip(res["hashes"][1:], res["hashes"][2:]))
        assert res["hashes"] == results[0]["hashes"]
        rejected = [e for e in res["log"] if e["decision"] == "reject"]
        assert not rejected, rejected
        # no microbatch lost or used twice: every (kind, mb) of this stage exactly once per iteration
        for it, ex in enumerate(res["executed"]):
            kinds = {k for k, _, _ in ex}
            # backward="auto": the first plan runs B for odd microbatches, I + W for even (backward.py)
            first = res["versions"][it] == 1
            assert kinds in ({"F", "I", "W"}, {"F", "B"}) or (first and kinds == {"F", "B", "I", "W"}), (it, kinds)
            mbs = {kind: sorted(m for k, s, m in ex if k == kind and s == rank) for kind in "FIWB"}
            assert mbs["F"] == sorted(mbs["I"] + mbs["B"]) == list(range(n_mb)), (rank, it, mbs)
            assert mbs["W"] == mbs["I"], (rank, it, mbs)
        for p, q in zip(res["params"], res["ref_params"]):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)
        # training actually moved the parameters (the comparison is not trivially true)
        init = [p.detach() for p in mlp_stages(world, DIM)[rank].parameters()]
        assert max((p - q).abs().max().item() for p, q in zip(res["params"], init)) > 1e-3
    last = results[-1]
    assert len(last["losses"]) == steps and all(len(x) == n_mb for x in last["losses"])
    for got, want in zip(last["losses"], last["ref_losses"]):
        assert got == pytest.approx(want, rel=1e-9, abs=0)


def _bad_plan(world: int, n_mb: int, what: str) -> dict:
    plan = {r: list(a) for r, a in builtin_plan("1F1B", world, n_mb)[0].items()}
    if what == "lost_microbatch":  # stage 1 never runs microbatch n_mb-1
        plan[1] = [a for a in plan[1] if a.microbatch_index != n_mb - 1]
    elif what == "backward_first":  # a backward before its forward on the last rank
        acts = plan[world - 1]
        first_b = next(i for i, a in enumerate(acts) if a.computation_type == _ComputationType.FULL_BACKWARD)
        acts.insert(0, acts.pop(first_b))
    elif what == "duplicate":
        plan[0] = plan[0] + [_Action(0, _ComputationType.FORWARD, 0)]
    return plan


class BadOncePolicy:
    """At the first check, asks the (background) planning path to deploy an invalid plan."""

    window = 1
    forces = True

    def __init__(self, bad):
        self.bad, self.calls = bad, 0

    def decide(self, estimate, deployed_counts, initial_counts, since, slack_floor=2):
        self.calls += 1
        if self.calls == 1:
            return Decision("force", "invalid plan through the planner path", actions=self.bad)
        return Decision("keep", "test")


def _reject_worker(rank: int, world: int, n_mb: int):
    mods_ref = mlp_stages(world, DIM, seed=3)
    mods = mlp_stages(world, DIM, seed=3)
    ref = ScheduleGPipe(PipelineStage(mods_ref[rank], rank, world, torch.device("cpu")), n_mb, loss_fn=Fn.mse_loss)
    sched = PipeMorph(PipelineStage(mods[rank], rank, world, torch.device("cpu")), n_mb, loss_fn=Fn.mse_loss,
                      adaptive=False, policy=BadOncePolicy(_bad_plan(world, n_mb, "lost_microbatch")))
    opt_ref = torch.optim.SGD(mods_ref[rank].parameters(), lr=0.05)
    opt = torch.optim.SGD(mods[rank].parameters(), lr=0.05)
    out = {"accepted": [], "versions": [], "losses": [], "ref_losses": []}
    good = builtin_plan("1F1B", world, n_mb)[0]
    for k in range(6):
        if k in (1, 2, 3):
            before = sched.deployed.hash
            ok = sched.deploy(_bad_plan(world, n_mb, ["lost_microbatch", "backward_first", "duplicate"][k - 1]))
            out["accepted"].append((ok, sched.deployed.hash == before))
        if k == 4:  # a valid plan pushed *during* an iteration is queued until the boundary
            def hook(action, ctx, _sched=sched):
                out["mid_iteration"] = _sched.deploy(good, reason="pushed mid-iteration")
                out["version_during"] = _sched.plan_version
                _sched.register_custom_function(_ComputationType.REDUCE_GRAD, _reduce)
                _reduce(action, ctx)
            sched.register_custom_function(_ComputationType.REDUCE_GRAD, hook)
            out["version_before"] = sched.plan_version
        out["versions"].append(sched.plan_version)
        opt.zero_grad(); opt_ref.zero_grad()
        out["losses"].append(_step(sched, rank, world, k))
        out["ref_losses"].append(_step(ref, rank, world, k))
        opt.step(); opt_ref.step()
        if k == 4:
            out["version_after"] = sched.plan_version
    out["log"] = list(sched.decision_log)
    out["params_close"] = all(torch.allclose(p, q, rtol=1e-9, atol=1e-12)
                              for p, q in zip(mods[rank].parameters(), mods_ref[rank].parameters()))
    return out


def _reduce(action, ctx):
    sched = ctx.schedule_ref
    stage = sched._stages[0]
    stage.perform_reduce_grad(sched._n_microbatches if sched.scale_grads else 1)


@pytest.mark.multiprocess
def test_invalid_plan_is_rejected_and_previous_plan_keeps_training(two_ranks):
    results = two_ranks["reject"]
    for res in results:
        assert res["accepted"] == [(False, True)] * 3
        rejects = [e for e in res["log"] if e["decision"] == "reject"]
        reasons = [e["reason"] for e in rejects]
        assert len(reasons) == 4, reasons
        # background planning path (planned at boundary 0, refused at the end of iteration 1)
        background = [e for e in rejects if "planning/validation failed" in e["reason"]]
        assert len(background) == 1 and background[0]["iteration"] == 1
        assert "stage 1 microbatch 3 has no F" in background[0]["reason"]
        # synchronous deploy() path, in push order
        external = [r for r in reasons if r.startswith("external")]
        assert "stage 1 microbatch 3 has no F" in external[0]
        assert "comes before" in external[1]
        assert "appears 2 times" in external[2]
        # versions unchanged by the rejected plans; the mid-iteration push waited for the boundary
        assert res["versions"][:5] == [1] * 5
        assert res["mid_iteration"] is None and res["version_during"] == res["version_before"] == 1
        assert res["version_after"] == 2
        assert res["params_close"]
    last = results[-1]
    for got, want in zip(last["losses"], last["ref_losses"]):
        assert got == pytest.approx(want, rel=1e-9, abs=0)


def _planresult_worker(rank: int, world: int, n_mb: int, steps: int):
    """deploy(PlanResult): plans of plan_by_name deployed now and queued mid-iteration, counting every
    conversion of the plan IR to torch's actions (the runtime's one pass, ``deploy.to_torch_actions``)."""
    import titan_ext.plan.ir as ir
    import titan_ext.runtime.control.deploy as deploy
    from titan_ext.plan.schedules import plan_by_name

    ref_losses, ref_params = gpipe_reference(rank, world, n_mb, steps, lambda s, k: _step(s, rank, world, k), DIM)
    profile = PipelineProfile.uniform(world, n_mb, 10, 10, 10, delays_ms={0: 30})
    plans = {"crosspipe": plan_by_name(profile, "crosspipe-ud"), "1F1B": plan_by_name(profile, "1F1B")}
    spies = {"pass": mock.Mock(wraps=deploy.to_torch_actions), "ir": mock.Mock(wraps=ir.to_torch_plan)}
    ir.to_torch_plan, deploy.to_torch_actions = spies["ir"], spies["pass"]

    def calls() -> dict:
        return {k: spy.call_count for k, spy in spies.items()}
    out: dict = {"type_errors": []}
    mods = mlp_stages(world, DIM)
    sched = PipeMorph(PipelineStage(mods[rank], rank, world, torch.device("cpu")), n_mb, loss_fn=Fn.mse_loss,
                      adaptive=False)
    out["initial_calls"] = calls()
    for bad in (42, "x", [plans["1F1B"].ops[0]]):
        try:
            sched.deploy(bad)
        except TypeError as e:
            out["type_errors"].append(str(e))
    opt = torch.optim.SGD(mods[rank].parameters(), lr=0.05)
    out.update(losses=[], versions=[])
    for k in range(steps):
        if k == 1:
            out["deployed"] = sched.deploy(plans["crosspipe"], reason="crosspipe-ud")
            out["hash_after_deploy"] = sched.deployed.hash
        if k == 2:  # pushed *during* the iteration: queued until its end
            def hook(action, ctx, _sched=sched):
                out["mid_iteration"] = _sched.deploy(plans["1F1B"], reason="queued 1F1B")
                out["version_during"] = _sched.plan_version
                _sched.register_custom_function(_ComputationType.REDUCE_GRAD, _reduce)
                _reduce(action, ctx)
            sched.register_custom_function(_ComputationType.REDUCE_GRAD, hook)
        out["versions"].append(sched.plan_version)
        opt.zero_grad()
        out["losses"].append(_step(sched, rank, world, k))
        opt.step()
    out["final_version"], out["final_hash"] = sched.plan_version, sched.deployed.hash
    out["calls"] = calls()
    out["planner_torch_copies"] = ["actions" in vars(p) for p in plans.values()]
    out["hashes"] = {name: plan_hash(p.ops) for name, p in plans.items()}
    out["log"] = list(sched.decision_log)
    out["ref_losses"] = ref_losses
    out["params_close"] = all(torch.allclose(p, q, rtol=1e-9, atol=1e-12)
                              for p, q in zip(mods[rank].parameters(), ref_params))
    return out


@pytest.mark.multiprocess
def test_deploy_takes_a_plan_result(two_ranks):
    """``deploy()`` takes a PlanResult (plan_by_name's): deployed now, or queued during an iteration and
    deployed at its end; training equals torch's GPipe; each plan reaches torch's IR exactly once, in the
    runtime's lowering pass (the planner's torch copy is never made); anything else is a TypeError."""
    results = two_ranks["planresult"]
    for res in results:
        assert len(res["type_errors"]) == 3 and all("plan" in e for e in res["type_errors"]), res["type_errors"]
        assert "PlanResult" in res["type_errors"][0]
        assert res["deployed"] is True and res["hash_after_deploy"] == res["hashes"]["crosspipe"]
        assert res["mid_iteration"] is None and res["version_during"] == 2
        assert res["versions"] == [1, 2, 2, 3, 3] and res["final_hash"] == res["hashes"]["1F1B"]
        assert not [e for e in res["log"] if e["decision"] == "reject"]
        # one conversion per prepared plan (initial, deployed, queued), all of them the runtime's pass
        assert res["initial_calls"] == {"pass": 1, "ir": 1} and res["calls"] == {"pass": 3, "ir": 3}
        assert res["planner_torch_copies"] == [False, False]
        assert res["params_close"]
    last = results[-1]
    for got, want in zip(last["losses"], last["ref_losses"]):
        assert got == pytest.approx(want, rel=1e-9, abs=0)


class NoisyPipeMorph(PipeMorph):
    """Each rank perturbs its *local* measurements differently (rank-dependent timing noise)."""

    def _local_profile_vector(self, prof):
        vec = super()._local_profile_vector(prof)
        g = torch.Generator().manual_seed(7919 * (self.rank + 1) + self.iteration)
        vec[3:7] = vec[3:7] * (1 + 0.5 * torch.rand(4, generator=g, dtype=torch.float64))
        return vec


class DissentingPipeMorph(PipeMorph):
    """Rank 1 plans something else than the others (as if from its own local view): the hash
    exchange must catch it before anything is deployed."""

    def _plan(self, profile, decision):
        if self.rank == 1 and decision.action == "adapt":
            from titan_ext.plan.result import make_result

            actions = builtin_plan("GPipe", self.pp_group_size, self._n_microbatches)[0]
            return make_result(actions, schedule="dissent", predicted_makespan_ms=float("nan"), plan_ms=0.0)
        return super()._plan(profile, decision)


def _agreement_worker(rank: int, world: int, n_mb: int, cls_name: str):
    from titan_ext.runtime import inject_link_delays
    from titan_ext.testing import SleepComputeStage

    cls = {"noisy": NoisyPipeMorph, "dissent": DissentingPipeMorph}[cls_name]
    mod = SleepComputeStage(DIM, 2.0, 2.0, 1.0, seed=rank)
    sched = cls(PipelineStage(mod, rank, world, torch.device("cpu")), n_mb, loss_fn=Fn.mse_loss,
                policy=ReplanPolicy(window=1))
    inject_link_delays(f"{world - 2}:25")
    hashes = []
    for k in range(5):
        x, y = _batch(k)
        step_rank(sched, rank, world, x.float(), y.float())
        hashes.append(sched.deployed.hash)
    return {"hashes": hashes, "log": list(sched.decision_log), "metrics": list(sched.metrics_history)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", [pytest.param("noisy", marks=pytest.mark.slow), "dissent"])
def test_ranks_agree_on_every_deployed_plan(variant):
    world, n_mb = 3, 16
    results = run_ranks(_agreement_worker, world, n_mb, variant)
    assert all(r["hashes"] == results[0]["hashes"] for r in results)
    deploys = [[(e["iteration"], e["plan_hash"]) for e in r["log"] if e["decision"] == "deploy"] for r in results]
    assert all(d == deploys[0] for d in deploys)
    if variant == "noisy":
        # the slow link was adapted to despite rank-specific noise in the local measurements
        assert any(e["decision"] == "deploy" and e["kind"] == "adaptive" for e in results[0]["log"])
    else:
        # rank 1's different plan was detected by the hash exchange and never deployed anywhere
        for r in results:
            rejects = [e for e in r["log"] if e["decision"] == "reject"]
            assert rejects and "disagree" in rejects[0]["reason"]
            assert not any(e["decision"] == "deploy" and e["kind"] == "adaptive" for e in r["log"])


def _adapt_worker(rank: int, world: int, n_mb: int, t_ms: float, delay_ms: float, on: int, off: int, steps: int):
    from titan_ext.runtime import inject_link_delays
    from titan_ext.testing import SleepComputeStage

    injector = inject_link_delays("")
    mod = SleepComputeStage(DIM, t_ms, t_ms, t_ms, seed=rank)
    # the slackness adaptation alone: backward="auto"'s probes are tested in test_runtime_backward.py
    sched = PipeMorph(PipelineStage(mod, rank, world, torch.device("cpu")), n_mb, loss_fn=Fn.mse_loss,
                      backward="split")
    for k in range(steps):
        if k == on:
            injector.update(f"{world - 2}:{delay_ms:g}")
        if k == off:
            injector.update("")
        x, y = _batch(k)
        if rank == 0:
            sched.step(x.float())
        elif rank == world - 1:
            sched.step(target=y.float())
        else:
            sched.step()
    return {"log": list(sched.decision_log), "metrics": list(sched.metrics_history),
            "initial": sched.initial_counts}


@pytest.mark.multiprocess
def test_adapts_to_slow_last_link_and_shrinks_after_recovery():
    """60 ms on the last link from iteration 3: PipeMorph re-plans within 3 iterations with more
    slackness on that link (enough for Eq.1), which absorbs the delay; delay removed at iteration 10:
    slackness shrinks back (Alg.1's plan) after the hysteresis.

    "Absorbs the delay" is a ratio against same-run baselines: what the delay adds to the iteration
    time of the adapted plans (vs the adapted plans from iteration 10 on, without the delay) is under
    half of what it adds to the initial plan's (vs its iterations 1-2).  Not "iteration time falls below
    0.85x the first slow iteration": under NCCL's rules (nccl_rules, the default backend) the larger
    plan costs more by itself, delay or not (+7-36 % over the small plan on this loaded 2-core host,
    gloo +0-5 %; the cause is not isolated), which shrank that gain to 0.84-0.93x.  Each time is the
    plan's fastest iteration in its window: host noise (preemption, CPU contention, a new plan's first
    iterations) only ever adds time.  Compute is 10 ms a pass (sleeps): at 5 ms (and 30 ms of delay)
    the four ranks' own CPU time was a third of an iteration, and with both cores busy the
    iterations became CPU-bound and hid the delay."""
    from titan_ext.plan import required_slackness

    world, n_mb, t_ms, delay, on, off, steps = 4, 16, 10.0, 60.0, 3, 10, 17
    link = world - 2
    results = run_ranks(_adapt_worker, world, n_mb, t_ms, delay, on, off, steps)
    res = results[0]
    deploys = [e for e in res["log"] if e["decision"] == "deploy"]
    assert all([(e["iteration"], e["plan_hash"]) for e in r["log"] if e["decision"] == "deploy"]
               == [(e["iteration"], e["plan_hash"]) for e in deploys] for r in results)
    metrics = res["metrics"]
    adapt = [e for e in deploys if e["iteration"] >= on and e["kind"] == "adaptive"]
    assert adapt, [(m["iteration"], m["decision"], m["link_delay_ms"]) for m in metrics]
    first = adapt[0]
    assert first["iteration"] <= on + 2  # decided at the end of iteration on..on+2, runs from the next
    initial_slack = res["initial"][link] - res["initial"][link + 1]
    assert first["slackness"][link] > initial_slack
    # the new Δ satisfies Eq.1 for the measured delay and compute times at that time
    m = metrics[first["iteration"]]
    prof = PipelineProfile(world, n_mb, tuple(m["compute_ms"]["F"]), tuple(m["compute_ms"]["I"]),
                           tuple(m["compute_ms"]["W"]))
    need = required_slackness(prof, link, delay_ms=m["link_delay_estimate_ms"][link])
    assert first["slackness"][link] >= min(need, n_mb - 2 * world)
    # measured delay on the slow link ~ injected; healthy links stay well below it
    slow_it = metrics[on + 1]
    assert 0.9 * delay <= slow_it["link_delay_ms"][link] <= delay + 15.0
    # recovery: a shrink back to less slackness after the delay is gone (the policy's deploys: a refine's, a
    # probe's or a select's keep the regime — on a loaded host a plan can run > 5 % above its prediction)
    policy = [e for e in deploys if e["reason"].startswith(("adapt:", "shrink:"))]
    shrink = [e for e in policy if e["iteration"] >= off]
    assert shrink, [(m["iteration"], m["decision"], m["decision_reason"]) for m in metrics[off:]]
    # the adapted plan absorbs the delay: it costs that plan under half what it costs the initial plan
    slack_at_onset = metrics[on]["slackness"][link]

    def fastest(adapted: bool, lo: int, hi: int) -> float:
        """The fastest iteration in [lo, hi) of the plans with more slackness on the link than at the
        onset (adapted) or not."""
        times = [m["iteration_time_ms"] for m in metrics[lo:hi] if (m["slackness"][link] > slack_at_onset) == adapted]
        assert times, (adapted, lo, hi, [(m["iteration"], m["slackness"], m["decision"]) for m in metrics])
        return min(times)

    cost_initial = fastest(False, on, first["iteration"]) / fastest(False, 1, on) - 1.0
    cost_adapted = fastest(True, first["iteration"] + 1, off) / fastest(True, off, steps) - 1.0
    assert cost_adapted < 0.5 * cost_initial, (cost_adapted, cost_initial,
                                               [round(m["iteration_time_ms"]) for m in metrics])
    assert shrink[0]["slackness"][link] < first["slackness"][link]
    # on a quiet host the first shrink lands on Alg.1's plan; under heavy load the window's medians can
    # still carry part of the delay, so a shrink may go there in two steps — never back up (no flapping)
    assert all(b["slackness"][link] < a["slackness"][link] for a, b in zip(shrink, shrink[1:]))
    assert len([e for e in policy if e["iteration"] >= on]) <= 3, deploys


def _budget_worker(rank: int, world: int, n_mb: int, budget: float):
    mods = mlp_stages(world, DIM, seed=5)
    # the memory rule alone: this MLP's compute takes microseconds, so Eq.1's tolerances are ~0 and a
    # link reading of a few ms (host scheduling on a busy 2-core machine; the nccl_rules backend's
    # thread hops) would make the policy adapt instead of calibrating; a 1 s margin keeps it to the budget
    sched = PipeMorph(PipelineStage(mods[rank], rank, world, torch.device("cpu")), n_mb, loss_fn=Fn.mse_loss,
                      memory_budget_bytes=budget, policy=ReplanPolicy(abs_margin_ms=1000.0))
    counts = [list(sched.deployed.warmup_counts)]
    for k in range(3):
        _step(sched, rank, world, k)
        counts.append(list(sched.deployed.warmup_counts))
    return {"counts": counts, "act": sched.executor.activation_bytes, "log": list(sched.decision_log),
            "x_max": sched.memory.x_max}


@pytest.mark.multiprocess
def test_initial_plan_from_memory_budget_and_measured_activations(two_ranks):
    """Alg.1 from a byte budget: M^F is measured in the first forward. For this MLP stage (2 × Linear
    + Tanh, float64, microbatch of BATCH/N rows) autograd saves 3 distinct [rows, DIM] tensors
    (stage input, tanh outputs; weights excluded), so M^F = 3·rows·DIM·8 bytes and
    x_max = ⌊M / M^F⌋."""
    from titan_ext.plan import initial_warmup_counts

    world, n_mb = 2, BUDGET_MB
    rows = BATCH // n_mb
    act = 3 * rows * DIM * 8
    assert BUDGET == 10.5 * act
    results = two_ranks["budget"]
    assert results[1]["act"] == act + rows * DIM * 8  # the last stage's loss saves its target as well
    for res in results:
        assert res["act"] >= act
        assert res["counts"][0] == initial_warmup_counts(world, world)  # before measuring: 1F1B's memory
        assert res["x_max"] == 10  # x_max = ⌊10.5⌋
        # the calibrated plan holds at most x_max: Alg.1's [10, 1], or a candidate the model times the same
        # with fewer activations (the planner's tie rule; which one depends on the measured link readings)
        assert res["counts"][-1][0] <= 10
        assert any(e["decision"] == "deploy" and "calibrate" in e["reason"] for e in res["log"]), res["log"]


def _small_budget_worker(rank: int, world: int, n_mb: int, budget: float):
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("titan_ext.runtime.adaptive").addHandler(handler)
    res = _budget_worker(rank, world, n_mb, budget)
    return {**res, "warnings": [m for m in records if "memory budget" in m]}


@pytest.mark.multiprocess
def test_absurd_memory_budget_warns_once_from_rank_0(two_ranks):
    """`memory_budget_gib = 1e-9` trained silently with warm-up counts [1, ...]. A budget of half
    an activation is applied (the cap is 1) but said once, by PP rank 0 only."""
    results = two_ranks["small_budget"]
    assert len(results[0]["warnings"]) == 1 and results[1]["warnings"] == [], results
    assert "holds [1, 1] in-flight activations per stage" in results[0]["warnings"][0]
    assert "less than 1F1B holds ([2, 1])" in results[0]["warnings"][0]


# -- the two-rank tests above share one run (a module fixture): a spawn of two ranks costs seconds ----------
BUDGET_MB = 16
BUDGET = 10.5 * 3 * (BATCH // BUDGET_MB) * DIM * 8       # 10.5 activations of the MLP stage (M^F, see above)
SMALL_MB = 8
SMALL_BUDGET = 0.5 * 3 * (BATCH // SMALL_MB) * DIM * 8   # half an activation


def _two_rank_parts(rank: int, world: int) -> dict:
    """Each part builds its own schedules on the one process group, in turn; the PlanResult part last, as it
    wraps the runtime's IR lowering with counting spies for the rest of the process."""
    return {"reject": _reject_worker(rank, world, 4),
            "budget": _budget_worker(rank, world, BUDGET_MB, BUDGET),
            "small_budget": _small_budget_worker(rank, world, SMALL_MB, SMALL_BUDGET),
            "planresult": _planresult_worker(rank, world, 4, 5)}


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, list]:
    results = run_ranks(_two_rank_parts, 2)
    return {name: [r[name] for r in results] for name in results[0]}
