"""``polish_plan``: the bounded CP-SAT + search polish of any split-backward plan with one
stage per rank — PipeMorph's here, where its generator is known to be off — accepted only under the one
rule it shares with ``polish_crosspipe`` (validator under the per-stage in-flight limit and the profile's
memory rule, strictly faster under the simulator); plans outside its model come back unchanged."""

from __future__ import annotations

import pytest

from titan_ext.plan import PipelineProfile, validate_plan
from titan_ext.plan.polish import polish_plan
from titan_ext.plan.result import peak_inflight
from titan_ext.plan.schedules import plan_by_name
from titan_ext.plan.simulate import replay_makespan_ns
from titan_ext.plan.timing import to_ms

pytest.importorskip("ortools")

#: S = 4, N = 8, F/I/W = 6/12/10 ms, link 1 +40 ms, the runtime's memory rule (held until W), x_max 7:
#: PipeMorph's Alg.1 plan (the fastest of its candidates) times 358 ms, the polish finds 324 ms
PROFILE = PipelineProfile(4, 8, 6.0, 12.0, 10.0, release="W").with_delays({1: 40.0})


def _pipemorph(memory_limit: int = 7):
    return plan_by_name(PROFILE, "pipemorph", mode="initial", memory_limit=memory_limit)


@pytest.mark.parametrize("memory_limit", [7, 4])
def test_polish_improves_pipemorph_where_it_is_off(memory_limit):
    plan = _pipemorph(memory_limit)
    out = polish_plan(PROFILE, plan, budget_s=0.5)
    report = out.info["polish"]
    assert report["status"] == "improved" and out.source == plan.source + "+polish"
    before, after = replay_makespan_ns(plan.ops, PROFILE), replay_makespan_ns(out.ops, PROFILE)
    assert after < before and to_ms(after) == pytest.approx(out.predicted_makespan_ms)
    assert (report["sim_before_ms"], report["sim_after_ms"]) == (to_ms(before), to_ms(after))
    # the plan's own per-stage limit, under the profile's memory rule (an activation held until its W)
    limit = plan.inflight_limit
    validate_plan(out.actions, 4, 8, inflight_limit=limit, release="W")
    assert all(p <= limit[s] for s, p in peak_inflight(out.ops, "W").items())
    assert out.inflight_limit == list(limit) and out.stage_to_rank == plan.stage_to_rank


def test_an_explicit_memory_limit_replaces_the_plans_own():
    """``memory_limit`` is the limit the polish plans and is checked under (here looser than the plan's 4:
    the polish uses the room); the result records it as its ``inflight_limit``."""
    plan = _pipemorph(4)
    out = polish_plan(PROFILE, plan, budget_s=0.5, memory_limit=7)
    peaks = peak_inflight(out.ops, "W")
    assert out.info["polish"]["status"] == "improved" and out.inflight_limit == [7] * 4
    assert 4 < max(peaks.values()) <= 7
    validate_plan(out.actions, 4, 8, inflight_limit=7, release="W")
    assert out.predicted_makespan_ms < polish_plan(PROFILE, plan, budget_s=0.5).predicted_makespan_ms


def test_plans_outside_the_polish_model_come_back_unchanged():
    full = plan_by_name(PROFILE, "pipemorph", mode="initial", memory_limit=7, backward="full")
    out = polish_plan(PROFILE, full, budget_s=0.5)
    assert out.ops is full.ops and out.info["polish"]["status"].startswith("skipped: full backward")
    assert "polish" not in full.info  # the input is not modified
    virtual = plan_by_name(PipelineProfile(2, 4, 10.0, 10.0, 10.0), "pipemorph", virtual_stages=2, placement="v")
    out = polish_plan(virtual.profile, virtual, budget_s=0.5)
    assert out.ops is virtual.ops and out.info["polish"]["status"].startswith("skipped: 2 stages per rank")
    with pytest.raises(ValueError, match="polish budget"):
        polish_plan(PROFILE, full, budget_s=0)


def test_the_shared_acceptance_rule_refuses_what_the_validator_or_simulator_refuses(monkeypatch):
    """The rule ``polish_crosspipe`` uses too (tests/plan/test_plan_polish.py): a plan over the in-flight limit
    (GPipe's order) or one not faster (the input itself) never comes back."""
    import titan_ext.plan.polish as polish

    plan = _pipemorph(7)
    gpipe = {r: [(r, "F", m) for m in range(8)] + [x for m in range(8) for x in ((r, "I", m), (r, "W", m))]
             for r in range(4)}
    for fake, why in ((gpipe, "the validator refused it"), (plan.ops, "not below the input's")):
        monkeypatch.setattr(polish, "polish_orders", lambda *a, fake=fake, **k: (fake, {"status": "improved"}))
        out = polish_plan(PROFILE, plan, budget_s=0.5)
        assert out.ops is plan.ops and out.info["polish"]["status"].startswith("rejected: ")
        assert why in out.info["polish"]["status"]


def test_polish_plan_is_deterministic(monkeypatch):
    """Every rank of a job polishes on its own and must get the same plan (tests/runtime/test_runtime_polish.py);
    the CP-SAT stage's wall-clock safety net is widened as in tests/plan/test_plan_polish.py."""
    import titan_ext.plan.polish as polish

    monkeypatch.setattr(polish, "POLISH_CPSAT_WALL", 100.0)
    plan = _pipemorph(7)
    assert polish_plan(PROFILE, plan, budget_s=0.3).ops == polish_plan(PROFILE, plan, budget_s=0.3).ops
