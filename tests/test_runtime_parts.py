"""The runtime's parts on their own, without a process group (issue 13 item 1): deployment (validate +
torch's lowering), the estimator, planners and background planning, the memory cap, the metrics
record, the local control plane, and the executor running torch's lowered actions on two local
stages against plain autograd."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as Fn
from torch.distributed.pipelining import schedules as torch_schedules

from titan_ext.plan import PipelineProfile, PlanValidationError, plan_crosspipe, plan_pipemorph
from titan_ext.plan.builtin import builtin_plan
from titan_ext.plan.ir import as_ops
from titan_ext.runtime.control import ControlPlane
from titan_ext.runtime.deploy import backward_of, plan_hash, prepare_candidate, warmup_counts_of
from titan_ext.runtime.estimator import Estimator
from titan_ext.runtime.memory import inflight_cap
from titan_ext.runtime.metrics import IterationMetrics
from titan_ext.runtime.planning import (
    BackgroundPlanning,
    CrossPipePlanner,
    PipeMorphPlanner,
    PlanningContext,
    explicit_plan,
)
from titan_ext.runtime.policy import Decision
from titan_ext.runtime.profiler import RankProfile

S, N = 4, 8


def test_prepare_candidate_lowers_exactly_like_torch():
    plan = builtin_plan("1F1B", S, N)[0]
    cand = prepare_candidate(plan, None, "external", "test", num_stages=S, n_microbatches=N, num_ranks=S)
    # torch's own lowering of the same plan (what _prepare_schedule_with_comms would produce)
    mapping = {s: s for s in range(S)}
    want = {r: torch_schedules._add_reduce_grad(list(a), N) for r, a in plan.items()}
    want = torch_schedules._add_send_recv(want, stage_to_rank=lambda s: mapping[s], num_stages=S)
    assert {r: [str(a) for a in acts] for r, acts in cand.lowered.items()} == \
        {r: [str(a) for a in acts] for r, acts in want.items()}
    assert cand.counts == [S - i for i in range(S)] == warmup_counts_of(plan)
    assert cand.backward == backward_of(plan) == "full"
    assert cand.hash == plan_hash(plan) != plan_hash(builtin_plan("GPipe", S, N)[0])


@pytest.mark.parametrize("damage,match", [("drop", "has no F"), ("swap_rank", "expected 0..")])
def test_prepare_candidate_refuses_bad_plans(damage, match):
    plan = {r: list(a) for r, a in builtin_plan("1F1B", S, N)[0].items()}
    if damage == "drop":
        plan[1] = [a for a in plan[1] if a.microbatch_index != N - 1]
    else:
        del plan[3]
    with pytest.raises(PlanValidationError, match=match):
        prepare_candidate(plan, None, "external", "bad", num_stages=S, n_microbatches=N, num_ranks=S)


def _rank(f, i, w, b=math.nan):
    return RankProfile(0, 0, f, i, w, b, 0.0, 0.0, 0.0, 0.0, math.nan, math.nan, math.nan, 0.0, 0, [], [], [], [])


def test_estimator_takes_window_medians_and_keeps_old_rows_when_nothing_was_measured():
    est = Estimator(2, N, window=3, initial_times_ms=(7.0, 8.0, 9.0))
    assert est.profile().f_ms == (7.0, 7.0) and est.profile().delays_ms == (0.0,)
    for f, c in ((1.0, 10.0), (100.0, 12.0), (3.0, 11.0)):
        est.push([_rank(f, 2.0, 1.0), _rank(2 * f, 2.0, 1.0)], [c])
    prof = est.profile()
    assert prof.f_ms == (3.0, 6.0) and prof.delays_ms == (11.0,)
    # a full-backward iteration (I, W unmeasured) leaves the split window as it was
    est.push([_rank(3.0, math.nan, math.nan, 5.0), _rank(6.0, math.nan, math.nan, 5.0)], [11.0])
    assert est.profile().b_ms == (2.0, 2.0) and est.profile("full").b_ms == (5.0, 5.0)
    assert est.profile("full").w_ms == (0.0, 0.0)
    # the window holds 3 rows: the outlier 100 has left
    assert est.profile().f_ms == (3.0, 6.0)


def _context(**kw):
    base = dict(backward="split", x_max=2 * S - 1, adaptive_limit=None, slack_floor=2,
                headroom=lambda c: c * 1.1 + 1.0)
    base.update(kw)
    return PlanningContext(**base)


def test_planners_match_the_plan_layer_they_wrap():
    prof = PipelineProfile(S, 16, 5.0, 5.0, 5.0).with_delays({S - 2: 30.0})
    got = PipeMorphPlanner().plan(prof, Decision("adapt", "t", mode="adaptive"), _context())
    want = plan_pipemorph(prof.with_delays({S - 2: 30.0 * 1.1 + 1.0}), mode="adaptive", validate=False)
    assert as_ops(got.actions) == as_ops(want.actions)
    got = CrossPipePlanner().plan(prof, Decision("initial", "t", mode="initial"), _context())
    assert as_ops(got.actions) == as_ops(plan_crosspipe(prof, "udsub", memory_limit=2 * S - 1).actions)
    with pytest.raises(ValueError, match="'ud' or 'udsub'"):
        CrossPipePlanner("zb")
    # a decision that names its warm-up counts never reaches the planner
    plan = explicit_plan(prof, Decision("force", "t", warmup_counts=[4, 3, 2, 1]), "full")
    assert warmup_counts_of(plan.actions) == [4, 3, 2, 1] and backward_of(plan.actions) == "full"
    assert explicit_plan(prof, Decision("adapt", "t"), "split") is None


def test_background_planning_hands_over_the_candidate_or_the_error():
    bg = BackgroundPlanning()
    assert bg.candidate_hash() == 0 and not bg.running
    plan = builtin_plan("GPipe", S, N)[0]
    bg.start(Decision("force", "t"), lambda: prepare_candidate(plan, None, "forced", "t", num_stages=S,
                                                               n_microbatches=N, num_ranks=S), "t")
    assert bg.candidate_hash() == plan_hash(plan)
    cand, decision, _, wall_ms, cpu_ms = bg.take()
    assert cand.hash == plan_hash(plan) and decision.action == "force" and wall_ms >= 0 and cpu_ms >= 0
    bg.start(Decision("force", "t"), lambda: (_ for _ in ()).throw(PlanValidationError("nope")), "what")
    assert bg.candidate_hash() == 0
    cand, _, error, _, _ = bg.take()
    assert cand is None and "what: planning/validation failed: nope" == error and not bg.running


def test_memory_cap_is_the_tightest_rank():
    # rank 1: 10 GB / 1 GB = 10; rank 0: 4.5 GB / 0.5 GB = 9; rank 2 has no budget (CPU, none configured)
    assert inflight_cap([4.5e9, 10e9, math.nan], [0.5e9, 1e9, 2e9], 16) == 9
    assert inflight_cap([math.nan] * 3, [1.0] * 3, 16) is None
    assert inflight_cap([1e12], [1.0], 16) == 16 and inflight_cap([1.0], [1e9], 16) == 1


def test_metrics_dict_keeps_the_published_keys():
    m = IterationMetrics(3, 12.5, decision="keep", extra={"falcon/event": "none"})
    d = m.as_dict()
    for key in ("iteration", "iteration_time_ms", "bubble_rate", "timeline_span_ms", "link_delay_ms",
                "link_delay_estimate_ms", "compute_ms", "backward", "plan_version", "plan_hash", "warmup_counts",
                "slackness", "eq1_tolerance_ms", "replan_ms", "deployed", "plan_ms", "plan_cpu_ms", "swap_ms",
                "exchange_ms", "boundary_ms", "decision", "decision_reason", "recv_wait_ms", "inflight_cap"):
        assert key in d, key
    assert d["iteration"] == 3 and d["falcon/event"] == "none" and "extra" not in d


def test_control_plane_without_a_process_group_is_local():
    cp = ControlPlane(None)
    assert cp.local and cp.size == 1
    assert cp.agree(5) == (True, [5]) and cp.any(True) and not cp.any(False)
    assert [t.tolist() for t in cp.all_gather(torch.tensor([1.0, 2.0]))] == [[1.0, 2.0]]
    assert all(math.isnan(x) for x in cp.clock_offsets())


@pytest.fixture
def single_rank_group():
    """torch's PipelineStage asks the default group for its rank: a one-rank in-memory gloo group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_executor_runs_two_local_stages_like_autograd(single_rank_group):
    """Two stages on one rank (no communication): a split-backward action list runs through the
    executor; losses and gradients equal plain autograd's, every compute action is timed."""
    from titan_ext.runtime.testing import mlp_stages
    from titan_ext.runtime.executor import Executor, RunContext
    from torch.distributed.pipelining import PipelineStage

    n = 4
    mods, ref = mlp_stages(2, 8), mlp_stages(2, 8)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(8, 8, generator=g, dtype=torch.float64)
    stages = [PipelineStage(mods[i], i, 2, torch.device("cpu")) for i in range(2)]
    # torch's runtime owns the per-step state (receive tables, counters, loss) and sets the stages up
    sched = torch_schedules._PipelineScheduleRuntime(stages, n, loss_fn=Fn.mse_loss, scale_grads=False)
    arg_mbs, kwarg_mbs = sched._split_inputs((x,), {})
    ys = list(y.chunk(n))
    for st in stages:  # what step() sets for a training step
        st.has_backward = True
    sched._initialize_stages(arg_mbs[0], kwarg_mbs[0], ys[0])
    xs = [a[0] for a in arg_mbs]
    from torch.distributed.pipelining.schedules import _Action, _ComputationType as C
    # F all, then per microbatch I on stage 1 and 0, then all W (a split-backward order)
    actions = [_Action(s, C.FORWARD, m) for m in range(n) for s in (0, 1)]
    actions += [_Action(s, C.BACKWARD_INPUT, m) for m in range(n) for s in (1, 0)]
    actions += [_Action(s, C.BACKWARD_WEIGHT, m) for m in range(n) for s in (1, 0)]
    ex = Executor(torch.device("cpu"))
    ctx = RunContext(sched, {0: stages[0], 1: stages[1]}, arg_mbs, kwarg_mbs, ys, None)
    ex.run(actions, ctx)
    losses = [sched._internal_losses[m].item() for m in range(n)]  # torch's own loss state
    want = [Fn.mse_loss(ref[1](ref[0](a)), b) for a, b in zip(xs, ys)]
    sum(want).backward()
    assert losses == pytest.approx([w.item() for w in want], rel=1e-12)
    for mod, rmod in zip(mods, ref):
        for p, q in zip(mod.parameters(), rmod.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
    assert sorted((r.kind, r.stage, r.microbatch) for r in ctx.profile.actions) == sorted(
        (a.computation_type.value, a.stage_index, a.microbatch_index) for a in actions)
    assert all(r.end >= r.start for r in ctx.profile.actions) and ex.activation_bytes > 0
