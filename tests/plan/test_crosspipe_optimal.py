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


# ----------------------------------------------------------------------------- independent references
def _interleavings(chains):
    """All merges of the given sequences (each keeps its internal order)."""
    if all(not c for c in chains):
        yield []
        return
    for i, c in enumerate(chains):
        if c:
            rest = list(chains)
            rest[i] = c[1:]
            for tail in _interleavings(rest):
                yield [c[0]] + tail


def _brute_force(prob: CrossPipeProblem) -> float:
    """Optimum by enumeration: every per-rank order that keeps each microbatch's F → I → W (any
    interleaving, microbatches in any order), timed by replay (left-shifted, messages FIFO), memory
    checked in program order.  Semi-active schedules include an optimal one, so this is the optimum
    of §4.1 without any of the solver's symmetry breaking or redundant constraints."""
    import itertools

    N, R = prob.num_microbatches, prob.num_ranks
    per_rank = []
    for r in range(R):
        (s,) = prob.stages_of_rank(r)
        cands = _interleavings([[(s, k, m) for k in ("F", "I", "W")] for m in range(N)])
        if prob.memory_limit is not None:  # memory is per rank: filter each rank's orders alone
            cands = (o for o in cands if peak_memory(prob, {q: o if q == r else [] for q in range(R)})[r]
                     <= prob.memory_limit[r] + 1e-9)
        per_rank.append(list(cands))
    best = float("inf")
    for combo in itertools.product(*per_rank):
        orders = dict(enumerate(combo))
        try:
            rep = replay(prob, orders)
        except ValueError:  # deadlock (an order waiting on its own rank's later op)
            continue
        # makespan from the first F anywhere (replay measures from F of microbatch 0, which need
        # not come first in an unordered plan)
        best = min(best, max(rep.end_ms.values()) - min(rep.start_ms.values()))
    return best


def _tiny_problem(rng: random.Random, stages: int, micro: int) -> CrossPipeProblem:
    grid = lambda lo, hi: round(rng.uniform(lo, hi), 1)  # noqa: E731
    return CrossPipeProblem(
        num_ranks=stages, num_microbatches=micro, stage_to_rank=tuple(range(stages)),
        f_ms=tuple(grid(0.5, 2) for _ in range(stages)), b_ms=tuple(grid(0.5, 2) for _ in range(stages)),
        w_ms=tuple(grid(0.2, 2) for _ in range(stages)),
        link_latency_ms=tuple(rng.choice([0.0, 0.5, 2.0]) for _ in range(stages - 1)),
        link_transfer_ms=tuple(rng.choice([0.0, 0.4, 1.5]) for _ in range(stages - 1)),
        memory_limit=None if rng.random() < 0.4 else tuple(float(rng.randint(1, micro)) for _ in range(stages)),
    )


@pytest.mark.parametrize("stages,micro,count,limit", [(1, 3, 3, None), (2, 2, 8, None), (2, 3, 3, 1), (3, 2, 3, None)])
def test_optimum_equals_brute_force(stages, micro, count, limit):
    """The strengthened model's optimum equals exhaustive enumeration over per-rank orders (S=2, N=3
    with memory limit 1, which keeps the enumeration small)."""
    rng = random.Random(100 * stages + micro)
    for _ in range(count):
        prob = _tiny_problem(rng, stages, micro)
        if limit is not None:
            prob = prob.with_memory_limit([float(limit)] * stages)
        res = _solve(prob)
        assert res.makespan_ms == pytest.approx(_brute_force(prob), abs=1e-6), prob


def _random_small(rng: random.Random, i: int) -> CrossPipeProblem:
    if i % 5 == 4:
        return _random_problem(rng, wave=True)
    prob = _random_problem(rng, wave=False)
    if i % 5 == 3 and prob.memory_limit is not None:  # W keeps half of the activation
        return CrossPipeProblem(prob.num_ranks, prob.num_microbatches, prob.stage_to_rank, prob.f_ms, prob.b_ms,
                                prob.w_ms, prob.link_latency_ms, prob.link_transfer_ms,
                                tuple(x + 0.5 for x in prob.memory_limit), (1.0, -0.5, -0.5))
    return prob


def test_strengthened_model_keeps_the_optimum():
    """24 random small instances (UD, CrossWave, W-held memory, limits, delays): the strengthened
    model (memory precedences, ordered messages, head/tail domains, Jackson bounds, polished hint)
    has the same optimum as the plain §4.1 model with microbatch order, and as the model without
    microbatch order (the symmetry breaking) where that one is small enough to prove quickly."""
    rng = random.Random(2026)
    for i in range(24):
        prob = _random_small(rng, i)
        strong = _solve(prob)
        plain = _solve(prob, redundant=False)
        assert strong.makespan_ms == pytest.approx(plain.makespan_ms, abs=1e-6), (i, prob)
        assert strong.params["root_bound_ms"] <= strong.makespan_ms + 1e-6
        if prob.num_microbatches * prob.num_stages <= 8:
            free = _solve(prob, microbatch_order=False)
            assert strong.makespan_ms == pytest.approx(free.makespan_ms, abs=1e-6), (i, prob)


def test_returned_plan_replays_to_the_objective():
    """The replayed makespan of the returned orders equals the solver's objective; the bound is below
    every greedy plan; the plan validates with the memory limit."""
    rng = random.Random(7)
    for _ in range(6):
        prob = _tiny_problem(rng, 3, 4)
        res = _solve(prob)
        assert replay(prob, res.orders).makespan_ms == pytest.approx(res.makespan_ms, abs=1e-6)
        for v in ("ud", "udsub"):
            assert res.bound_ms <= plan_crosspipe_problem(prob, v).makespan_ms + 1e-6
        limit = None if prob.memory_limit is None else [int(x) for x in prob.memory_limit]
        validate_plan(res.actions, prob.num_stages, prob.num_microbatches, inflight_limit=limit)


def test_deterministic_search_is_reproducible():
    """deterministic=True (interleaved search, deterministic time): two runs return the same plan."""
    prob = CrossPipeProblem.uniform(3, 6, 1.3, 1.1, 0.7, latency_ms={1: 1.5}, transfer_ms={1: 0.5}, memory_limit=3)
    a = solve_optimal_problem(prob, time_limit_s=10, workers=2, deterministic=True)
    b = solve_optimal_problem(prob, time_limit_s=10, workers=2, deterministic=True)
    assert a.proven and b.proven and a.orders == b.orders


def test_jackson_bound():
    from titan_ext.plan.optimal import _jackson_bound

    # one job: release 2, length 3, delivery 4 → 9
    assert _jackson_bound([(2, 3, 4)]) == 9
    # (0, 4, 0) then (1, 2, 5): preempt the first at 1 → second ends 3 (+5 = 8), first ends 6 → 8
    assert _jackson_bound([(0, 4, 0), (1, 2, 5)]) == 8
    # idle gap: (0, 1, 0), (5, 1, 0) → 6
    assert _jackson_bound([(0, 1, 0), (5, 1, 0)]) == 6


def test_benchmark_cache_format():
    """docs/benchmarks/crosspipe_solver_cache.json (scripts/solve_cases.py): one entry per bench case,
    bound ≤ makespan, equal when optimal."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "crosspipe_solver_cache.json"
    if not path.exists():
        pytest.skip("no solver cache yet")
    cache = json.loads(path.read_text())
    for cid, row in cache.items():
        assert cid[0] in "ABCD" and cid[1:].isdigit()
        assert set(row) >= {"makespan_ms", "bound_ms", "optimal", "wall_s"}
        assert row["bound_ms"] <= row["makespan_ms"] + 1e-6
        if row["optimal"]:
            assert row["bound_ms"] == pytest.approx(row["makespan_ms"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_case_b1_is_proven_within_the_time_limit():
    """B1 (S=4, N=12, a slow link) was the hardest of the bench's S ≤ 4 cases for the plain §4.1 model
    (unproven at 60 s). The solver must prove it within the issue's 60 s limit; the proven optimum is
    ≤ both greedy plans, the replayed plan reproduces it, and the plan validates (torch's dry run too)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from solve_cases import case_problems

    _, prob, _ = case_problems()["B1"]
    res = solve_optimal_problem(prob, time_limit_s=60, workers=2)
    assert res.proven and res.bound_ms == pytest.approx(res.makespan_ms)
    assert replay(prob, res.orders).makespan_ms == pytest.approx(res.makespan_ms, abs=1e-6)
    for variant in ("ud", "udsub"):
        assert res.makespan_ms <= plan_crosspipe_problem(prob, variant).makespan_ms + 1e-6
    validate_plan(res.actions, 4, 12)
