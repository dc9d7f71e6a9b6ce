"""runtime/control/lifecycle.py: candidate → validate → agree → swap, and why a plan is not deployed."""

import pytest

from titan_ext.runtime.control.deploy import Candidate
from titan_ext.runtime.control.lifecycle import DecisionLog, PlanLifecycle
from titan_ext.runtime.decide.policy import Decision


class Control:
    def __init__(self, agree=True):
        self.ok = agree

    def agree(self, h):
        return self.ok, [h, h + (0 if self.ok else 1)]


def _cand(h: int, kind="adaptive", reason="test") -> Candidate:
    return Candidate({0: []}, {0: []}, {0: 0}, [1], h, kind, reason)


def _lifecycle(agree=True):
    installed, state = [], {"in_iteration": False}
    log = DecisionLog(100, lambda: 7)
    life = PlanLifecycle("Sched", Control(agree), installed.append, lambda: state["in_iteration"], log)
    return life, installed, state, log


def test_agreed_plan_is_swapped_and_an_identical_one_is_not():
    life, installed, _, log = _lifecycle()
    assert life.deploy_now(lambda: _cand(0xA), "external", "first")
    assert life.version == 1 and life.deployed.hash == 0xA and [c.hash for c in installed] == [0xA]
    assert life.deploy_now(lambda: _cand(0xA), "external", "again")  # accepted, nothing swapped
    assert life.version == 1 and len(installed) == 1
    assert [e["decision"] for e in log.entries] == ["deploy", "unchanged"] and log.entries[0]["iteration"] == 7


def test_invalid_or_disputed_plans_are_rejected_and_the_deployed_one_stays():
    life, installed, _, log = _lifecycle(agree=False)

    def invalid():
        raise ValueError("lost microbatch 3")

    assert not life.deploy_now(invalid, "external", "bad")
    assert not life.deploy_now(lambda: _cand(0xB), "external", "disputed")
    assert life.deploy_now(lambda: _cand(0xC), "initial", "no vote", check_agreement=False)
    assert [c.hash for c in installed] == [0xC]
    reasons = [e["reason"] for e in log.entries if e["decision"] == "reject"]
    assert "validation failed: lost microbatch 3" in reasons[0] and "ranks disagree" in reasons[1]


def test_swaps_happen_only_between_iterations():
    life, installed, state, _ = _lifecycle()
    state["in_iteration"] = True
    with pytest.raises(RuntimeError, match="Sched: a plan may only be swapped at an iteration boundary"):
        life.deploy_now(lambda: _cand(1), "external", "mid-iteration")
    assert installed == []


@pytest.mark.parametrize("hashes, over_cap, deployed", [
    ([0xD, 0xD], "", True),
    ([0xD, 0xE], "", False),  # a rank planned something else
    ([0xD, 0xD], "above the current memory cap", False),
])
def test_background_candidate_is_swapped_only_if_agreed_and_within_the_cap(hashes, over_cap, deployed):
    life, installed, _, log = _lifecycle()
    decision = Decision("adapt", "slow link", mode="adaptive")
    life.start(decision, lambda: _cand(0xD), "adapt")
    assert life.candidate_hash() == 0xD
    res = life.resolve(hashes, lambda cand: over_cap)
    assert res.deployed is deployed and res.produced and res.decision is decision
    assert [c.hash for c in installed] == ([0xD] if deployed else [])
    assert not life.planning.running and life.resolve(hashes, lambda c: "").decision is None
    if not deployed:
        assert log.entries[-1]["decision"] == "reject"


def test_queued_external_plans_deploy_at_the_next_boundary():
    life, installed, _, _ = _lifecycle()
    life.queue({0: []}, "user")
    assert installed == []
    life.apply_pending(lambda plan, reason: (lambda: _cand(0xF, "external", reason)))
    assert [c.reason for c in installed] == ["user"]


def test_a_plan_whose_counts_do_not_decrease_deploys_with_no_slackness_reported():
    """A multi-stage plan carries its per-stage targets as counts ([8, 7, 8, …] from plan.virtual's search
    over a memory budget): its swap logged their slackness, which raised and ended a job at +60 ms."""
    life, installed, _, log = _lifecycle()
    cand = Candidate({0: []}, {0: []}, {0: 0}, [8, 7, 8, 4], 0xB, "adaptive", "multi-stage")
    assert life.deploy_now(lambda: cand, "external", "first")
    assert life.version == 1 and [c.hash for c in installed] == [0xB]
    assert log.entries[-1]["decision"] == "deploy" and log.entries[-1]["slackness"] is None
    monotone = Candidate({0: []}, {0: []}, {0: 0}, [8, 7, 4, 1], 0xC, "adaptive", "one stage per rank")
    assert life.deploy_now(lambda: monotone, "external", "second")
    assert log.entries[-1]["slackness"] == [1, 3, 3]


def test_a_refine_that_kept_the_plan_never_swaps_even_after_a_users_deploy():
    """A refine found no faster plan: its candidate (the plan deployed when it was decided) is logged
    unchanged and never installed, also when a user's ``deploy()`` swapped another plan in meanwhile."""
    life, installed, _, log = _lifecycle()
    assert life.deploy_now(lambda: _cand(0xA), "adaptive", "adapt")
    kept = Candidate({0: []}, {}, {}, [1], 0xA, "adaptive", "refine: (no plan 2 % faster)", trigger="refine",
                     keep=True)
    life.start(Decision("refine", "window full", mode="adaptive"), lambda: kept, "refine")
    assert life.deploy_now(lambda: _cand(0xB), "external", "user")  # the user's plan, while the refine ran
    res = life.resolve([0xA, 0xA], lambda cand: "")
    assert not res.deployed and res.produced
    assert [c.hash for c in installed] == [0xA, 0xB] and life.deployed.hash == 0xB
    assert [e["decision"] for e in log.entries] == ["deploy", "deploy", "unchanged"]
