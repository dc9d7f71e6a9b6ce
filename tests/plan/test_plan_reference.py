"""One dependency rule and one link timing (DESIGN.md "Timing model").

The reference is ``simulate`` (``plan/deps.py`` + ``plan/timing.LinkQueues``). Every fast evaluator — they
all walk ``deps.table`` (tests/plan/test_plan_deps_table.py) and send through ``LinkQueues`` or its C twin
``_link.h``: PipeMorph's generator and ``replay_makespan_ns``, the virtual-stage generator, CrossPipe's
greedy (Python and C) and the local search's incremental re-timing (``crosspipe.retime.Retimer`` and its
restart, the descent and annealing, Python and ``_search.c``) — is checked bit-for-bit (integer
nanoseconds) against it on random profiles with latency *and* bandwidth time (so messages queue on a
link), and CP-SAT's arcs (from the same table) are checked to be no weaker than the rule.
"""

import math
import random

import pytest

from titan_ext.plan import LinkProfile, PipelineProfile, generate_order, simulate
from titan_ext.plan.crosspipe import greedy_schedule, placed_from_profile, wave_profile
from titan_ext.plan.crosspipe.retime import Retimer
from titan_ext.plan.crosspipe.search import anneal, critical_moves, local_search, move_op
from titan_ext.plan.placement import stage_to_rank
from titan_ext.plan.simulate import replay_makespan_ns
from titan_ext.plan.timing import to_ns
from titan_ext.plan.virtual import generate_virtual_order, virtual_profile

SEEDS = range(12)


def _profile(rng: random.Random, S: int, N: int) -> PipelineProfile:
    """Random times (1 µs resolution), latencies and transfer times: contention on links is common."""
    ms = lambda lo, hi: round(rng.uniform(lo, hi), 3)  # noqa: E731
    links = tuple(LinkProfile(rng.choice((0.0, ms(0, 20))), rng.choice((math.inf, 1e9, 2e8)),
                              rng.choice((0.0, 1e6, 4e6))) for _ in range(S - 1))
    return PipelineProfile(S, N, [ms(0.5, 8) for _ in range(S)], [ms(0.5, 5) for _ in range(S)],
                           [rng.choice((0.0, ms(0, 3))) for _ in range(S)], links)


def _events_ns(timeline) -> dict:
    return {(e.stage, e.kind, e.microbatch): (to_ns(e.start_ms), to_ns(e.end_ms)) for e in timeline.events}


@pytest.mark.parametrize("seed", SEEDS)
def test_pipemorph_generator_and_replay_match_the_reference(seed):
    rng = random.Random(seed)
    S = rng.choice((2, 3, 4, 5))
    prof = _profile(rng, S, rng.choice((S, 2 * S, 3 * S)))
    N = prof.num_microbatches
    x = sorted((rng.randint(1, N) for _ in range(S)), reverse=True)
    for limit, full in ((None, False), (x, False), (None, True)):
        gen = generate_order(prof, x, limit, full_backward=full)
        ref = to_ns(simulate(gen.order, prof).makespan_ms)
        assert to_ns(gen.makespan_ms) == ref
        assert replay_makespan_ns(gen.order, prof) == ref


@pytest.mark.parametrize("seed", SEEDS)
def test_virtual_generator_matches_the_reference(seed):
    rng = random.Random(100 + seed)
    R = rng.choice((2, 3, 4))
    V, placement = rng.choice(((2, "loop"), (2, "v"), (3, "loop")))
    staged, s2r = virtual_profile(_profile(rng, R, V * R * rng.choice((1, 2))), V, placement)
    S, N = staged.num_stages, staged.num_microbatches
    x = sorted((rng.randint(1, N) for _ in range(S)), reverse=True)
    for limit in ([N] * S, x):
        gen = generate_virtual_order(staged, s2r, x, limit)
        ref = simulate(gen.order, staged, stage_to_rank=dict(enumerate(s2r)))
        assert to_ns(gen.makespan_ms) == to_ns(ref.makespan_ms)


def _retimer_events(model: Retimer, orders) -> dict:
    ids = model.ids(orders)
    timed = model.run(ids, detail=True)
    return {op: (timed.start[i], timed.start[i] + model.dur[i]) for r in range(model.R) for op, i in
            zip(orders[r], ids[r])}


@pytest.mark.parametrize("seed", SEEDS)
def test_crosspipe_greedy_and_retimer_match_the_reference_per_operation(seed):
    """CrossPipe's greedy (§4.2.3 reserves the earliest free window on a link) and the reference both
    queue FIFO (``LinkQueues``): every message on a link direction comes from one rank in its program
    order, so the two rules agree — here on every operation's start and end, not only the makespan; the
    local search's re-timing of a fixed order (``Retimer``) too, also of sub-block (n_sub > 1) plans."""
    rng = random.Random(200 + seed)
    S = rng.choice((2, 3, 4, 5))
    prof = _profile(rng, S, 2 * S * rng.choice((1, 2)))
    for variant, p in (("ud", prof), ("wave", wave_profile(prof))):
        problem = placed_from_profile(p, variant)
        greedy = greedy_schedule(problem, n_sub=1, steady=rng.choice(("interleave", "backward_first")))
        ref = _events_ns(simulate(greedy.orders, p, stage_to_rank=dict(enumerate(problem.stage_to_rank))))
        assert {op: (greedy.start_ns[op], greedy.end_ns[op]) for op in ref} == ref
        model = Retimer(problem)
        assert _retimer_events(model, greedy.orders) == ref
        assert model.run(model.ids(greedy.orders))[0] == greedy.makespan_ns == max(e for _, e in ref.values())
        sub = greedy_schedule(problem, n_sub=rng.choice((2, 3)), lookahead=True)
        assert _retimer_events(model, sub.orders) == _events_ns(simulate(sub.orders, p))


@pytest.mark.parametrize("seed", SEEDS[:6])
def test_incremental_retiming_and_search_match_the_reference(seed):
    """The local search re-times a plan from its first moved operation (``Retimer.rerun``): after each
    move (the critical-path ones and random ones), every operation's start and end equal the reference's
    on the moved plan; the descent's and the annealing's results (Python and ``_search.c``) are timed
    exactly as the reference times them."""
    rng = random.Random(400 + seed)
    S = rng.choice((3, 4))
    prof = _profile(rng, S, 2 * S)
    search_c = None
    try:
        from titan_ext.plan import _search_c as search_c
    except ImportError:
        pass
    checked = 0
    for variant, p in (("ud", prof), ("wave", wave_profile(prof))):
        problem = placed_from_profile(p, variant)
        model = Retimer(problem)
        ids = model.ids(greedy_schedule(problem).orders)
        base = model.run(ids, detail=True)
        moves = critical_moves(model, ids, base.start, base.avail, 4, 1, True)
        moves += [(r, q, min(len(ids[r]) - 1, q + rng.randint(1, 3))) for r in range(model.R)
                  for q in rng.sample(range(len(ids[r]) - 1), 3)]
        for r, a, b in moves:
            move_op(ids[r], a, b)
            orders = model.ops(ids)
            try:
                ref = _events_ns(simulate(orders, p))
            except ValueError:  # the move deadlocks the plan: the re-timing says so too
                assert model.rerun(ids, base, r, min(a, b), max(a, b))[0] == math.inf
            else:
                part = model.rerun(ids, base, r, min(a, b), max(a, b), detail=True)
                got = {op: (part.start[i], part.start[i] + model.dur[i]) for x in range(model.R)
                       for op, i in zip(orders[x], ids[x])}
                assert got == ref and part.makespan == max(e for _, e in ref.values())
                checked += 1
            move_op(ids[r], b, a)
        limit = problem.memory_limit or (math.inf,) * problem.num_ranks
        searched = [local_search(model, [list(o) for o in ids], limit, math.inf, max_evals=200, long_moves=1,
                                 gap_fill=True),
                    anneal(model, [list(o) for o in ids], limit, 200, seed, 0.01 * base.makespan)]
        if search_c is not None:
            spec = model.spec()
            searched += [search_c.descent(spec, ids, limit, 200, 4, 1, 1),
                         search_c.anneal(spec, ids, limit, 200, seed, 0.01 * base.makespan, 6)]
        for got_ids, mk, _ in searched:
            assert mk == to_ns(simulate(model.ops(got_ids), p).makespan_ms)
    assert checked > 20


def test_compiled_greedy_and_engine_match_the_reference():
    search_c = pytest.importorskip("titan_ext.plan._search_c", reason="compiled engine not built")
    from titan_ext.plan.crosspipe._compiled import available, greedy_ids

    if not available():
        pytest.skip("compiled greedy not built")
    rng = random.Random(300)
    for _ in range(8):
        S = rng.choice((3, 4, 5))
        prof = _profile(rng, S, 2 * S)
        for variant, p in (("ud", prof), ("wave", wave_profile(prof))):
            problem = placed_from_profile(p, variant)
            ids, mk, _ = greedy_ids(problem)
            model = Retimer(problem)
            orders = model.ops(ids)
            ref = simulate(orders, p, stage_to_rank=dict(enumerate(problem.stage_to_rank))).makespan_ms
            assert mk == to_ns(ref)
            assert search_c.run(model.spec(), ids, math.inf)[0] == to_ns(ref)


def test_optimal_arcs_are_no_weaker_than_the_rule():
    """CP-SAT's model writes the rule as arcs: its start times must be a feasible timing of its own
    order, i.e. never earlier than the reference's as-soon-as-possible start of the same operation."""
    pytest.importorskip("ortools")
    from titan_ext.plan.optimal import solve_optimal

    prof = PipelineProfile(3, 4, (1.0, 2.0, 1.5), (1.0, 1.0, 2.0), (0.5, 0.0, 1.0),
                           (LinkProfile(2.0, 1e9, 1e6), LinkProfile(0.0, 1e9, 2e6)))
    res = solve_optimal(prof, time_limit_s=10)
    timeline = simulate(res.actions, prof)
    asap = {(e.stage, e.kind, e.microbatch): e.start_ms for e in timeline.events}
    assert all(to_ns(res.start_ms[op]) >= to_ns(asap[op]) for op in asap)
    assert to_ns(timeline.makespan_ms) <= res.makespan_ns
    if res.proven:  # the optimum of its own model: the reference cannot do better with that order
        assert to_ns(timeline.makespan_ms) == res.makespan_ns


def test_placement_of_the_reference_and_the_generators_agree():
    """The generators and the reference read one placement model (plan/placement.py)."""
    prof = PipelineProfile.uniform(3, 12, 6.0, 6.0, 3.0, delays_ms={1: 9.0})
    for V, placement in ((2, "loop"), (2, "v"), (3, "loop")):
        staged, s2r = virtual_profile(prof, V, placement)
        assert s2r == stage_to_rank(3, V, placement)
        gen = generate_virtual_order(staged, s2r, [1] * len(s2r))
        rank_level = simulate(gen.order, prof, stage_to_rank=dict(enumerate(s2r)))  # splits the rank times itself
        assert to_ns(rank_level.makespan_ms) == to_ns(gen.makespan_ms)
