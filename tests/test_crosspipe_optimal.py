"""CP-SAT optimum (CrossPipe §4.1): hand-derived optima, optimum ≤ every greedy plan, validity.

Small instances only (S ≤ 3, N ≤ 6, ≤ 20 s each, 1 worker); every assertion is against a value derived
by hand below or against the greedy generators, never against captured solver output.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("ortools")

from titan_ext.plan import PipelineProfile, LinkProfile, simulate, validate_plan  # noqa: E402
from titan_ext.plan.crosspipe import (  # noqa: E402
    CrossPipeProblem,
    peak_memory,
    plan_crosspipe_problem,
    replay,
)
from titan_ext.plan.optimal import solve_optimal, solve_optimal_problem, time_unit_for  # noqa: E402

LIMIT_S = 20.0


def _solve(problem, **kw):
    res = solve_optimal_problem(problem, time_limit_s=LIMIT_S, workers=1, **kw)
    assert res.proven, (res.status, res.makespan_ms, res.bound_ms)
    return res


# ----------------------------------------------------------------------------- hand-derived optima
def test_two_stages_two_microbatches_no_delay():
    """S=2, N=2, F=B=W=1. Lower bounds: rank 1 starts at 1 and has 6 units of work → 7; rank 0's first
    I cannot start before 3 (F, F', I' of microbatch 0) and 4 units (2 I, 2 W) follow → 7.
    Schedule reaching 7: r0 F0 F1 · I0 W0 I1 W1, r1 · F0 I0 F1 I1 W0 W1.  Optimum = 7."""
    assert _solve(CrossPipeProblem.uniform(2, 2, 1, 1, 1)).makespan_ms == pytest.approx(7.0)


@pytest.mark.parametrize("c,d", [(0.5, 0.0), (2.0, 0.0), (0.5, 0.3), (1.0, 1.0)])
def test_two_stages_with_latency_and_bandwidth(c, d):
    """Same with latency c and transfer d ≤ t per message: rank 0's first I waits for F, msg, F', I',
    msg = 3 + 2(c + d), then 4 more units → ≥ 7 + 2(c + d); the schedule above, with rank 1 running
    I0 before F1, reaches it (no message ever queues since d ≤ t).  Optimum = 7 + 2(c + d)."""
    prob = CrossPipeProblem.uniform(2, 2, 1, 1, 1, latency_ms=c, transfer_ms=d)
    assert _solve(prob).makespan_ms == pytest.approx(7 + 2 * (c + d))


def test_three_stages_zero_bubble():
    """S=3, N=3, t=1, no memory limit: the last stage starts at 2 and has 9 units → ≥ 11; stage 0 idles
    until its first I at 5 with 6 units left → ≥ 11; zero-bubble schedules reach (S−1)t + 3Nt = 11."""
    assert _solve(CrossPipeProblem.uniform(3, 3, 1, 1, 1)).makespan_ms == pytest.approx(11.0)


@pytest.mark.parametrize("stages,micro", [(2, 3), (3, 3)])
def test_memory_limit_one(stages, micro):
    """Limit 1 everywhere: F(0, m+1) needs I(0, m) done, so microbatches go through the 2S-long F/I
    chain one after another (2SN·t), plus the last W of stage 0 → T* = 2SN·t + t; every other W fits
    into the idle time of its stage (≥ 2t between a stage's I and its next F)."""
    prob = CrossPipeProblem.uniform(stages, micro, 1, 1, 1, memory_limit=1)
    res = _solve(prob)
    assert res.makespan_ms == pytest.approx(2 * stages * micro + 1)
    assert max(peak_memory(prob, res.orders)) <= 1


# ----------------------------------------------------------------------------- optimum vs greedy
def _random_problem(rng: random.Random, wave: bool) -> CrossPipeProblem:
    ranks = rng.randint(2, 3) if not wave else 2
    stages = 2 * ranks if wave else ranks
    micro = rng.randint(ranks, 6 if not wave else 4)
    grid = lambda lo, hi: round(rng.uniform(lo, hi), 1)  # noqa: E731 — 0.1 ms grid: exact integers
    from titan_ext.plan.crosspipe import wave_stage_to_rank

    return CrossPipeProblem(
        num_ranks=ranks,
        num_microbatches=micro,
        stage_to_rank=wave_stage_to_rank(ranks) if wave else tuple(range(ranks)),
        f_ms=tuple(grid(0.5, 2) for _ in range(stages)),
        b_ms=tuple(grid(0.5, 2) for _ in range(stages)),
        w_ms=tuple(grid(0.2, 2) for _ in range(stages)),
        link_latency_ms=tuple(rng.choice([0.0, 0.5, 2.0]) for _ in range(stages - 1)),
        link_transfer_ms=tuple(rng.choice([0.0, 0.4, 1.5]) for _ in range(stages - 1)),
        memory_limit=None if rng.random() < 0.3 else tuple(float(rng.randint(2 if wave else 1, 4)) for _ in range(ranks)),
    )


def test_optimum_is_below_every_greedy_plan():
    """S ≤ 3, N ≤ 6, random times, delays and memory limits: the proven optimum ≤ the makespan of every
    greedy plan (CrossUD, CrossUDSub, CrossWave; each of its portfolio members), and the solver's own
    plan validates, respects memory and, timed by our model, is no faster than the proven bound."""
    rng = random.Random(6)
    for i in range(16):
        wave = i % 4 == 3
        prob = _random_problem(rng, wave)
        res = _solve(prob)
        variants = ("wave",) if wave else ("ud", "udsub")
        for v in variants:
            plan = plan_crosspipe_problem(prob, v)
            for *_, ms in plan.candidates:
                assert res.makespan_ms <= ms + 1e-6, (i, v, res.makespan_ms, ms)
        validate_plan(res.actions, prob.num_stages, prob.num_microbatches)
        if prob.memory_limit is not None:
            assert all(p <= lim + 1e-9 for p, lim in zip(peak_memory(prob, res.orders), prob.memory_limit))
        assert replay(prob, res.orders).makespan_ms >= res.bound_ms - 1e-6


def test_microbatch_order_constraint_keeps_the_optimum():
    """The paper's search-space reduction (same-type ops of a stage in microbatch order) does not change
    the optimum on small instances."""
    for prob in (
        CrossPipeProblem.uniform(2, 3, 1, 1.5, 0.5, latency_ms=0.7, transfer_ms=0.4, memory_limit=2),
        CrossPipeProblem(2, 3, (0, 1), (1.0, 2.0), (1.5, 1.0), (0.5, 1.0), (1.0,), (0.0,), (2.0, 2.0)),
    ):
        a = _solve(prob, microbatch_order=True)
        b = _solve(prob, microbatch_order=False)
        assert a.makespan_ms == pytest.approx(b.makespan_ms)


def test_profile_api_and_simulator_agree():
    """solve_optimal on a PipelineProfile: validated plan; the core simulator times it at the optimum."""
    links = (LinkProfile(latency_ms=2.0, bandwidth_bytes_per_s=1e9, message_bytes=1e6),)
    prof = PipelineProfile(2, 4, (1.0, 2.0), (1.0, 1.5), (1.0, 0.5), links)
    res = solve_optimal(prof, time_limit_s=LIMIT_S, memory_limit=[2, 1])
    assert res.proven
    sim = simulate(res.actions, prof)
    assert sim.makespan_ms >= res.bound_ms - 1e-6
    assert sim.makespan_ms == pytest.approx(res.makespan_ms)
    assert max(sim.peak_inflight.values()) <= 2 and sim.peak_inflight[1] <= 1


def test_time_unit():
    assert time_unit_for([1.0, 2.0, 30.0]) == 1.0
    assert time_unit_for([1.5, 0.25]) == pytest.approx(0.01)
    assert time_unit_for([1 / 3]) == pytest.approx(1e-3)  # not representable: finest grid, rounded


def test_weight_gradient_memory_share():
    """Memory deltas (M_F, M_D, M_W) = (1, −0.5, −0.5): half of an activation stays until W. With a limit
    of 1.5 a stage can hold at most one activation plus one W-half, so both the solver and the greedy
    must run each W before the second F after it; the optimum cannot beat the (1, −1, 0) optimum at the
    same limit (a strictly tighter constraint)."""
    base = dict(num_ranks=2, num_microbatches=3, stage_to_rank=(0, 1), f_ms=(1.0, 1.0), b_ms=(1.0, 1.0),
                w_ms=(1.0, 1.0), link_latency_ms=(0.5,), link_transfer_ms=(0.0,), memory_limit=(1.5, 1.5))
    split = CrossPipeProblem(**base, memory_deltas=(1.0, -0.5, -0.5))
    loose = CrossPipeProblem(**base)
    a, b = _solve(split), _solve(loose)
    assert a.makespan_ms >= b.makespan_ms - 1e-9
    assert max(peak_memory(split, a.orders)) <= 1.5 + 1e-9
    greedy = plan_crosspipe_problem(split, "udsub")
    assert max(peak_memory(split, greedy.orders)) <= 1.5 + 1e-9
    assert a.makespan_ms <= greedy.makespan_ms + 1e-9
