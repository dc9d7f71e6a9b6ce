"""A refined plan is verified once its window is measured (``runtime/control/regime.py`` "Verified"): run
more than ``MODEL_TOLERANCE`` above its prediction, the other backward variant is probed with its warm-up
counts; within it, the plan stays and nothing is planned.  Driven at the regime's own interface (the
decision at a check, the background job it starts) on a 4-stage pipeline with the estimator's initial
times (F = I = W = 1 ms, no delay): the prediction is the simulator's makespan of the deployed plan under
them, computed here by the simulator; the measured spans are set against it."""

from __future__ import annotations

import dataclasses

import pytest

from titan_ext.plan import simulate
from titan_ext.plan.placement import stage_to_rank
from titan_ext.plan.schedules import plan_by_name
from titan_ext.runtime.control.config import AdaptiveConfig
from titan_ext.runtime.control.deploy import Candidate, DeployedPlan, backward_of
from titan_ext.runtime.control.parts import build_parts
from titan_ext.runtime.control.regime import MODEL_TOLERANCE, Regime
from titan_ext.runtime.decide.placement import Layout
from titan_ext.runtime.decide.planning import explicit_plan
from titan_ext.runtime.decide.policy import Decision
from titan_ext.runtime.schedules.pipemorph import PIPEMORPH

S, N = 4, 8


def _regime(backward: str = "auto", times=(1.0, 1.0, 1.0)) -> Regime:
    config = AdaptiveConfig(backward=backward, initial_times_ms=times)
    layout = Layout(S, 1, "loop", tuple(stage_to_rank(S, 1, "loop")))
    parts = build_parts("Test", layout, N, config, PIPEMORPH, lambda: None, lambda: None)
    regime = Regime(parts, config, S, log=lambda **kw: None)
    regime.calibrated = True
    return regime


def _refined(regime: Regime) -> DeployedPlan:
    """ZB-H1 (split backward) installed by a refine, as the schedule installs it."""
    plan = plan_by_name(regime.parts.estimator.planning_profile("split"), "zb-h1")
    cand = Candidate(plan.actions, {}, dict(enumerate(range(S))), plan.warmup_counts, 7, "initial",
                     "refine: planned again", "split", trigger="refine", plan=plan)
    regime.installed(cand)
    return DeployedPlan(plan.actions, list(plan.warmup_counts), 3, 7, cand.reason, "initial", "split")


def _measured(regime: Regime, deployed: DeployedPlan, ratio: float) -> None:
    """``window`` checks under the deployed plan, each span ``ratio`` × its prediction."""
    v = deployed.backward
    predicted = simulate(deployed.actions, regime.parts.estimator.planning_profile(v)).makespan_ms
    for _ in range(regime.parts.estimator.window.size):
        regime.checks_since_install += 1
        regime.backward.chooser.record(v, ratio * predicted)


def _job(regime: Regime, deployed: DeployedPlan, counts=None):
    """The check's decision and the candidate its background job makes (every plan it asks for recorded;
    ``counts``: the warm-up counts of the plans the refine makes, else the decision's own)."""
    decision = regime.decide(deployed, True, False, 10)
    planned, prepared = [], []

    def plan(profile, d):
        planned.append(d)
        return explicit_plan(profile, d if counts is None else dataclasses.replace(d, warmup_counts=counts), d.backward)

    def prepare(ops, counts, kind, reason, limit):
        prepared.append((counts, reason))
        return lambda: Candidate(ops, {}, {}, list(counts), 8, kind, reason, backward_of(ops))

    job, _ = regime.replan(decision, deployed, plan, prepare)
    return decision, job(), planned, prepared


def test_a_refine_makes_the_next_plan_due_for_verification_and_an_adapt_for_a_refine():
    regime = _regime()
    _refined(regime)
    assert regime.refine_due == "verify"
    plan = plan_by_name(regime.parts.estimator.planning_profile("split"), "zb-h1")
    regime.installed(Candidate(plan.actions, {}, {}, plan.warmup_counts, 9, "adaptive", "adapt", "split",
                               trigger="adapt", plan=plan))
    assert regime.refine_due == "refine"


def test_a_refined_plan_not_realised_has_its_other_variant_probed_with_its_counts():
    regime = _regime()
    deployed = _refined(regime)
    _measured(regime, deployed, 1.0 + 2 * MODEL_TOLERANCE)
    decision, cand, planned, prepared = _job(regime, deployed)
    assert decision.action == "verify" and decision.replans
    assert cand.trigger == "probe" and cand.backward == "full"
    assert [d.backward for d in planned] == ["full"] and planned[0].warmup_counts == deployed.warmup_counts
    assert prepared[0][0] == deployed.warmup_counts and "beyond 5 %" in prepared[0][1]
    assert regime.refine_due is None  # verified once


def test_a_refined_plan_realised_stays_and_nothing_is_planned():
    regime = _regime()
    deployed = _refined(regime)
    _measured(regime, deployed, 1.0 + MODEL_TOLERANCE / 2)
    decision, cand, planned, prepared = _job(regime, deployed)
    assert decision.action == "verify"
    assert cand.keep and cand.hash == deployed.hash and "within 5 %" in cand.reason
    assert planned == [] and prepared == []


@pytest.mark.parametrize("backward", ["split", "full", "measure"])
def test_no_verification_where_the_variant_is_not_the_models_choice(backward):
    regime = _regime(backward)
    deployed = _refined(regime)
    _measured(regime, deployed, 1.0 + 2 * MODEL_TOLERANCE)
    assert regime.decide(deployed, True, False, 10).action != "verify"


@pytest.mark.parametrize("times, probed", [((1.0, 1.9, 0.1), True), ((1.0, 1.0, 1.0), False)])
def test_a_realised_plan_whose_other_variant_ties_in_the_model_has_it_probed(monkeypatch, times, probed):
    """A calibrated full plan with 1F1B's counts, realised (measured at its prediction).  The refine plans
    both variants with the same counts: with W = 0.1 ms the split plan is predicted 32.7 ms against the full
    plan's 33 (−0.9 %, within ``MODEL_TOLERANCE``: the model cannot rank them) and is probed; with
    I = W = 1 ms it is predicted 30 ms (−9 %), a plan the model ranks: the refine deploys it (2 % faster)."""
    regime = _regime(times=times)
    counts = [4, 3, 2, 1]
    profile = regime.parts.estimator.planning_profile("full")
    plan = explicit_plan(profile, Decision("calibrate", "", warmup_counts=counts), "full")
    regime.installed(Candidate(plan.actions, {}, {}, counts, 5, "initial", "calibrate", "full",
                               trigger="calibrate", plan=plan))
    deployed = DeployedPlan(plan.actions, counts, 2, 5, "calibrate", "initial", "full")
    _measured(regime, deployed, 1.0)
    monkeypatch.setattr(regime.backward, "variants", lambda *a: ("split", "full"))  # both planned (B measured)
    decision, cand, planned, _ = _job(regime, deployed, counts)
    assert decision.action == "refine" and [d.backward for d in planned] == ["split", "full"]
    assert cand.backward == "split" and not cand.keep
    assert (cand.trigger == "probe") == probed
    assert ("a tie the model cannot rank" in cand.reason) == probed, cand.reason
