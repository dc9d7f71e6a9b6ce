"""runtime/decide/planning.py: the planners wrap the plan layer; background planning hands over its
outcome (moved from test_runtime_parts.py)."""

from __future__ import annotations

import pytest

from titan_ext.plan import PipelineProfile, PlanValidationError, plan_crosspipe, plan_pipemorph
from titan_ext.plan.builtin import builtin_plan
from titan_ext.plan.ir import as_ops
from titan_ext.runtime.control.deploy import backward_of, plan_hash, prepare_candidate, warmup_counts_of
from titan_ext.runtime.decide.planning import (
    BackgroundPlanning,
    CrossPipePlanner,
    PipeMorphPlanner,
    PlanningContext,
    explicit_plan,
)
from titan_ext.runtime.decide.policy import Decision

S, N = 4, 8


def _context(**kw):
    base = dict(backward="split", x_max=2 * S - 1, adaptive_limit=None, slack_floor=2,
                headroom=lambda c: c * 1.1 + 1.0)
    base.update(kw)
    return PlanningContext(**base)


def test_planners_match_the_plan_layer_they_wrap():
    prof = PipelineProfile(S, 16, 5.0, 5.0, 5.0).with_delays({S - 2: 30.0})
    got = PipeMorphPlanner().plan(prof, Decision("adapt", "t", mode="adaptive"), _context())
    # the head-room applies to every link's measured delay (1 ms on the idle ones too), in every mode:
    # the recalibrated initial plan is planned for the measured delays with it as well
    room = prof.with_delays({k: c * 1.1 + 1.0 for k, c in enumerate(prof.delays_ms)})
    want = plan_pipemorph(room, mode="adaptive", validate=False)
    assert as_ops(got.actions) == as_ops(want.actions)
    got = PipeMorphPlanner().plan(prof, Decision("calibrate", "t", mode="initial"), _context())
    want = plan_pipemorph(room, mode="initial", memory_limit=2 * S - 1, validate=False)
    assert as_ops(got.actions) == as_ops(want.actions) and got.profile.delays_ms == room.delays_ms
    got = CrossPipePlanner().plan(prof, Decision("initial", "t", mode="initial"), _context())
    assert as_ops(got.actions) == as_ops(plan_crosspipe(room, "udsub", memory_limit=2 * S - 1).actions)
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
