"""The compiled greedy generator (titan_ext.plan._greedy_c via crosspipe._compiled.greedy_ids) against the Python
reference crosspipe.greedy_schedule, both reading a PlacedProfile in integer ns: bit-identical orders,
makespan and lookahead waits, and the same ValueError cases, under both memory rules.  Correctness only
(no timing assertions)."""

from __future__ import annotations

import itertools
import random

import pytest

pytest.importorskip("titan_ext.plan._greedy_c", reason="compiled greedy not built (scripts/setup.sh builds it)")

from titan_ext.plan.crosspipe import PlacedProfile, greedy_schedule, wave_stage_to_rank  # noqa: E402
from titan_ext.plan.crosspipe import _compiled as compiled  # noqa: E402
from titan_ext.plan.crosspipe.retime import Retimer as _Model  # noqa: E402

from _plan_cases import placed, uniform_placed  # noqa: E402

COMBOS = list(itertools.product(
    (1, 2, 3, 4),                              # n_sub
    ("interleave", "backward_first"),          # steady
    ("one", 1, 2, "pending"),                  # reserve
    ("microbatch", "critical_path"),           # tie
    (False, True),                             # lookahead
))
CHUNKS, PER_CHUNK = 12, 25  # 300 random problems
FAST_CHUNKS = 1  # the default test tier sweeps 25 of them; the `slow` tier (CI, after it) 125 more,
CI_CHUNKS = 6    # the `soak` tier the other 150 (about 60 s on 2 cores)


def _random_problem(rng: random.Random, wave: bool) -> PlacedProfile:
    R = rng.randint(2, 8) if not wave else rng.randint(2, 5)
    N = rng.randint(1, 24) if not wave else rng.randint(1, 16)
    s2r = wave_stage_to_rank(R) if wave else tuple(range(R))
    S = len(s2r)
    style = rng.random()

    def t():
        if style < 0.3:  # few distinct values: many ties
            return rng.choice([0.0, 1.0, 1.0, 2.0])
        if style < 0.4:
            return 1.0
        return rng.choice([0.0, rng.uniform(0.0, 3.0), round(rng.uniform(0.0, 3.0), 1)])

    f = tuple(t() or 1.0 for _ in range(S))  # F and I take time (PipelineProfile), W may not
    b = tuple(t() or 2.0 for _ in range(S))
    w = tuple(t() for _ in range(S))
    lat = tuple(rng.choice([0.0, 0.25, rng.uniform(0.0, 2.0), 10.0]) for _ in range(S - 1))
    tx = tuple(rng.choice([0.0, 0.5, rng.uniform(0.0, 2.0), 25.0]) for _ in range(S - 1))
    if rng.random() < 0.15:
        lat = ()
    if rng.random() < 0.15:
        tx = ()
    per = [sum(1 for x in s2r if x == r) for r in range(R)]
    mode = rng.choice(["none", "loose", "tight"])
    if mode == "none":
        lim = None
    elif mode == "loose":
        lim = tuple(float(p * rng.randint(2, 10)) + rng.choice([0.0, 0.5]) for p in per)
    else:  # at or near the minimum: the greedy may deadlock (ValueError), also with 'one'
        lim = tuple(float(p + rng.randint(0, 2)) for p in per)
    return placed(s2r, N, f, b, w, lat, tx, lim, release=rng.choice("IIW"))


def _reference(problem, *args):
    try:
        res = greedy_schedule(problem, *args)
    except ValueError as e:
        return ("ValueError", str(e))
    return (_Model(problem).ids(res.orders), res.makespan_ns, res.waits)


def _compiled(problem, *args):
    try:
        return compiled.greedy_ids(problem, *args)
    except ValueError as e:
        return ("ValueError", str(e))


def test_available():
    assert compiled.available()


@pytest.mark.parametrize("chunk", [c if c < FAST_CHUNKS else pytest.param(c, marks=pytest.mark.slow)
                                   if c < CI_CHUNKS else pytest.param(c, marks=[pytest.mark.slow, pytest.mark.soak])
                                   for c in range(CHUNKS)])
def test_bit_identical_random(chunk):
    rng = random.Random(1000 + chunk)
    raised = 0
    for i in range(PER_CHUNK):
        problem = _random_problem(rng, wave=bool(i % 2))
        for combo in COMBOS:
            ref = _reference(problem, *combo)
            got = _compiled(problem, *combo)
            if ref[0] == "ValueError":
                raised += 1
            # exact equality: ids, makespan (integer ns) and waits
            assert got == ref, (chunk, i, combo, problem)
            if ref[0] != "ValueError":
                assert type(got[1]) is int and type(got[2]) is int
    if chunk == 0:
        assert raised > 0  # tight limits exercise the deadlock error too (also test_deadlock_same_error)


def test_uniform_and_int_inputs():
    cases = [
        uniform_placed(4, 8, 1.0, 1.0, 1.0),
        uniform_placed(8, 32, 1.0, 1.1, 0.9, latency_ms=0.2, transfer_ms=0.3),
        uniform_placed(4, 12, 1.0, 1.1, 0.9, wave=True, latency_ms=0.2, transfer_ms=0.3),
        uniform_placed(3, 6, 1.0, 2.0, 1.0, wave=True, memory_limit=2.0),
        uniform_placed(3, 6, 1.0, 2.0, 1.0, wave=True, memory_limit=3.0, release="W"),
        # int times and limits
        placed((0, 1, 2), 5, (1, 2, 3), (2, 2, 2), (3, 1, 0), (1, 0), (2, 5), (3, 2, 1)),
        # W times that do not split evenly into sub-blocks (whole ns: the first ones 1 ns longer)
        placed((0, 1), 3, (1.0, 1.0), (1.0, 1.0), (1.000001, 0.000003)),
    ]
    for problem in cases:
        for combo in COMBOS:
            assert _compiled(problem, *combo) == _reference(problem, *combo), (problem, combo)


def test_times_beyond_int64_go_through_python():
    """A plan whose times could pass 2**62 ns is not given to the compiled code (int64): the Python
    reference plans it (the same result by construction, big Python ints)."""
    big = placed((0, 1), 800, (1e9, 1e9), (1e9, 1e9), (1e9, 1e9))
    assert not compiled.exact_in_c(big) and compiled._entry(big)[1] is None
    ids, mk, _ = compiled.greedy_ids(big)
    assert (ids, mk) == _reference(big)[:2]


def test_large_reserve_and_bool_arguments():
    problem = uniform_placed(3, 6, 1.0, 2.0, 1.0, wave=True, memory_limit=40.0)
    for args in [(1, "interleave", 3, "microbatch", False), (2, "interleave", 2**40, "microbatch", True),
                 (True, "backward_first", True, "critical_path", 1), (2, "interleave", 17, "critical_path", 0)]:
        assert _compiled(problem, *args) == _reference(problem, *args), args


@pytest.mark.parametrize("kwargs", [
    dict(tie="later"), dict(n_sub=0), dict(n_sub=1.0), dict(n_sub="2"), dict(steady="eager"),
    dict(reserve=0), dict(reserve=1.5), dict(reserve="two"), dict(reserve=None),
    dict(tie="x", n_sub=0), dict(n_sub=0, steady="x"), dict(steady="x", reserve=0),
])
def test_bad_arguments_same_errors(kwargs):
    problem = uniform_placed(2, 2, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError) as ref:
        greedy_schedule(problem, **kwargs)
    with pytest.raises(ValueError) as got:
        compiled.greedy_ids(problem, **kwargs)
    assert str(got.value) == str(ref.value)


def test_deadlock_same_error():
    # one unit per stage on each rank: the V turn cannot proceed once the first F of stage 0 is in flight
    # with reserve=1 it is admitted; find a limit that makes the reference raise and compare
    found = 0
    for R in (2, 3, 4):
        s2r = wave_stage_to_rank(R)
        for lim in (2.0, 2.5, 3.0):
            problem = placed(s2r, 6, (1.0,) * len(s2r), (1.0,) * len(s2r), (1.0,) * len(s2r),
                             memory_limit=(lim,) * R)
            for combo in COMBOS:
                ref = _reference(problem, *combo)
                assert _compiled(problem, *combo) == ref
                found += ref[0] == "ValueError"
    assert found > 0


def test_specs_shared_across_memory_limits():
    # problems that differ only in memory_limit share one compiled spec; the limit is per call
    base = uniform_placed(3, 8, 1.0, 1.5, 0.7, wave=True, latency_ms=0.3, transfer_ms=0.6)
    variants = [base] + [base.with_memory_limit([lim] * 3) for lim in (2.0, 3.0, 4.0, 6.0, 9.0)]
    variants.append(PlacedProfile(base.profile, base.stage_to_rank, (3.0, 5.0, 4.0)))
    for _ in range(2):
        for problem in variants:
            for combo in COMBOS[::5]:
                assert _compiled(problem, *combo) == _reference(problem, *combo), (problem.memory_limit, combo)
