"""The bounded CP-SAT polish of CrossPipe plans (``titan_ext.plan.polish``): polished
plans pass the validator, are never slower under the simulator than their input, strictly faster where
the greedy + search is known to be off (reference: the CP-SAT optimum solved to optimality), and the
budget / size bound / names are checked."""

from __future__ import annotations

import random

import pytest

from titan_ext.plan import LinkProfile, PipelineProfile, simulate, validate_plan
from titan_ext.plan.crosspipe import plan_crosspipe
from titan_ext.plan.polish import polish_crosspipe
from titan_ext.plan.schedules import plan_by_name

pytest.importorskip("ortools")

# scripts/bench_optimality.py's held-out case B5 (S = 4, N = 12, link 1: α = 15 ms, size·β = 5 ms), memory
# limit S: the default CrossUDSub plan is 0.85 % above the optimum, which CP-SAT proves in well under 1 s
B5 = PipelineProfile(4, 12, (14.3, 12.5, 12.0, 10.9), (6.1, 13.3, 8.0, 10.7), (5.7, 12.3, 12.9, 7.8),
                     (LinkProfile(), LinkProfile(15.0, 2e9, 1e7), LinkProfile()))


def _valid(actions, profile: PipelineProfile, limit: int) -> float:
    """Validated (per-stage in-flight limit) simulated makespan."""
    validate_plan(actions, profile.num_stages, profile.num_microbatches, inflight_limit=[limit] * profile.num_stages)
    return simulate(actions, profile).makespan_ms


def test_polish_beats_the_greedy_where_it_is_off():
    """Independent reference: the §4.1 optimum proven by the solver itself (whole model, no polish)."""
    from titan_ext.plan.optimal import solve_optimal

    opt = solve_optimal(B5, memory_limit=4, time_limit_s=60)
    assert opt.proven
    greedy = plan_by_name(B5, "crosspipe-udsub", memory_limit=4)
    polished = plan_by_name(B5, "crosspipe-udsub", memory_limit=4, polish_s=1.0)
    before, after = _valid(greedy.actions, B5, 4), _valid(polished.actions, B5, 4)
    assert before > opt.makespan_ms + 1.0  # the greedy is off here (520.0 vs 515.6)
    assert opt.makespan_ms - 1e-6 <= after < before - 1e-6
    assert polished.info["polish"]["status"] == "improved"
    assert polished.predicted_makespan_ms == pytest.approx(after)


def _random_profile(rng: random.Random) -> PipelineProfile:
    S = rng.choice((3, 4))
    times = lambda: [round(rng.uniform(5.0, 15.0), 1) for _ in range(S)]  # noqa: E731
    links = [LinkProfile() for _ in range(S - 1)]
    links[rng.randrange(S - 1)] = LinkProfile(round(rng.uniform(5, 30), 1), 2e9, rng.choice((0.0, 1e7)))
    return PipelineProfile(S, rng.choice((2, 3)) * S, times(), times(), times(), tuple(links))


@pytest.mark.parametrize("seed", range(4))
def test_polish_valid_and_never_worse(seed):
    rng = random.Random(2500 + seed)
    prof = _random_profile(rng)
    S = prof.num_stages
    limit = rng.choice((S - 1, S))
    for variant in ("ud", "udsub"):
        plan = plan_crosspipe(prof, variant, memory_limit=limit)
        out = polish_crosspipe(prof, plan, budget_s=0.3)
        before, after = _valid(plan.actions, prof, limit), _valid(out.actions, prof, limit)
        assert after <= before + 1e-9
        assert out.polish["status"] in ("improved", "kept")
        assert (out.polish["status"] == "improved") == (after < before - 1e-9)
        assert out.makespan_ms == pytest.approx(after)
        assert max(out.peak_memory) <= limit


def test_polish_is_deterministic(monkeypatch):
    """Deterministic work limits: the same plan twice.  The wall-clock safety net of the CP-SAT stage
    (the one documented exception, for machines far slower than the calibration) is widened so that a
    busy test machine cannot trip it."""
    import titan_ext.plan.polish as polish

    monkeypatch.setattr(polish, "POLISH_CPSAT_WALL", 100.0)
    plan = plan_crosspipe(B5, "udsub", memory_limit=4)
    a = polish_crosspipe(B5, plan, budget_s=0.5)
    b = polish_crosspipe(B5, plan, budget_s=0.5)
    assert a.orders == b.orders


def test_polish_bounds_and_bad_input():
    plan = plan_crosspipe(B5, "udsub", memory_limit=4)
    skipped = polish_crosspipe(B5, plan, budget_s=1.0, max_ops=100)  # 3·N·S = 144 operations
    assert skipped.polish["status"].startswith("skipped: 144 operations")
    assert skipped.orders == plan.orders and skipped.actions is plan.actions
    for bad in (0, -1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="polish budget"):
            polish_crosspipe(B5, plan, budget_s=bad)
    with pytest.raises(ValueError, match="polish_s applies to"):
        plan_by_name(B5, "pipemorph", polish_s=1.0)
    with pytest.raises(ValueError, match="polish_s applies to"):
        plan_by_name(B5, "crosspipe-wave", polish_s=1.0)


def test_polish_guard_rejects_what_the_validator_or_simulator_refuses(monkeypatch):
    """The last guard, independent of the polish's own checks: a plan our validator refuses (here GPipe's
    order, every F first: N in-flight activations above the limit of 4) or one the simulator does not time
    below the input (the input itself) never comes back."""
    import titan_ext.plan.polish as polish

    plan = plan_crosspipe(B5, "udsub", memory_limit=4)
    gpipe = {r: [(r, "F", m) for m in range(12)] + [x for m in range(12) for x in ((r, "I", m), (r, "W", m))]
             for r in range(4)}
    for fake, why in ((gpipe, "the validator refused it"), (plan.orders, "not below the input's")):
        monkeypatch.setattr(polish, "polish_orders", lambda *a, fake=fake, **k: (fake, {"status": "improved"}))
        out = polish_crosspipe(B5, plan, budget_s=1.0)
        assert out.orders == plan.orders and out.actions is plan.actions
        assert out.polish["status"].startswith("rejected: ") and why in out.polish["status"]


def test_auto_and_the_runtime_planners_pass_the_budget():
    """``auto`` polishes its CrossUD plan (never slower than without); the run-time planners pass their
    per-call budget through (PipeMorph §6: re-planning in the background within an iteration)."""
    from titan_ext.runtime.decide.planning import CrossPipePlanner, PipeMorphPlanner

    plain = plan_by_name(B5, "auto", memory_limit=4)
    auto = plan_by_name(B5, "auto", memory_limit=4, polish_s=0.5)
    assert auto.info["polish"]["budget_s"] == 0.5
    assert _valid(auto.actions, B5, 4) <= _valid(plain.actions, B5, 4) + 1e-9
    from titan_ext.runtime.decide.planning import PlanningContext
    from titan_ext.runtime.decide.policy import Decision

    with pytest.raises(ValueError, match="schedule 'auto'"):
        PipeMorphPlanner("pipemorph", polish_s=1.0)
    with pytest.raises(ValueError, match="must be one of pipemorph, zb, zb-h1, auto; got '1F1B'"):
        PipeMorphPlanner("1F1B")  # torch's built-ins are not PipeMorph's planner (refused before any plan)
    ctx = PlanningContext(backward="split", x_max=4, adaptive_limit=None, slack_floor=2, headroom=lambda c: c)
    for planner in (PipeMorphPlanner("auto", polish_s=0.5), CrossPipePlanner("udsub", polish_s=0.5)):
        res = planner.plan(B5, Decision("adapt", "test", mode="initial"), ctx)
        assert res.info["polish"]["budget_s"] == 0.5
    res = CrossPipePlanner("udsub", polish_s=0.5).plan(B5, Decision("adapt", "test", mode="initial"), ctx)
    assert _valid(res.actions, B5, 4) < _valid(greedy_b5().actions, B5, 4)  # B5's greedy is off: polished


def greedy_b5():
    return plan_crosspipe(B5, "udsub", memory_limit=4)


def test_cli_polish_flag(capsys):
    """``titan-ext plan --polish S``: the report in ``--json``; off by default (no "polish" key); a
    schedule it does not apply to is a usage error (exit 2)."""
    import json

    from titan_ext.cli import main

    args = ["plan", "--schedule", "crosspipe-udsub", "--stages", "4", "--microbatches", "12", "--times",
            "14,6,6/12,13,12/12,8,13/11,11,8", "--delay", "1:20", "--memory-limit", "4", "--json"]
    assert main(args) == 0
    assert "polish" not in json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(args + ["--polish", "0.5"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["polish"]["status"] in ("improved", "kept") and out["polish"]["budget_s"] == 0.5
    assert out["polish"]["after_ms"] <= out["polish"]["before_ms"]
    assert main(["plan", "--schedule", "pipemorph", "--stages", "4", "--microbatches", "12", "--times", "10,10,10",
                 "--polish", "1"]) == 2
    assert "--polish applies to" in capsys.readouterr().err


@pytest.mark.slow
def test_polish_meets_the_held_out_target_where_the_default_misses_it():
    """Held-out D4 (S = 8, N = 32, a slow link; scripts/bench_optimality.py --first-seed 3): the default
    CrossUDSub plan is 3.41 % above CP-SAT's proven lower bound (docs/benchmarks/crosspipe_holdout_cache.json,
    the solver's own 60 s run), beyond the 1.5 % asked; the 2 s polish brings it within."""
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("bench_optimality", root / "scripts" / "bench_optimality.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    _, S, N, slow = next(c for c in bench.CONFIGS if c[0] == "D")
    prof = bench.make_profile(S, N, slow, 4)
    bound = json.loads((root / "docs/benchmarks/crosspipe_holdout_cache.json").read_text())["D4"]["bound_ms"]
    plan = plan_crosspipe(prof, "udsub", memory_limit=S)
    polished = polish_crosspipe(prof, plan, budget_s=2.0)
    assert _valid(plan.actions, prof, S) > 1.015 * bound
    assert bound - 1e-6 <= _valid(polished.actions, prof, S) <= 1.015 * bound
