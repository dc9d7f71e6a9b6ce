"""The compiled PipeMorph generator (``titan_ext.plan._pipemorph_c``, from ``_pipemorph.c``) against its
Python reference (``pipemorph._generate_py``): bit-identical orders, makespans (integer ns) and
cap_bound flags on random heterogeneous profiles — bandwidth-limited links (FIFO occupancy), warm-up
counts and in-flight caps under both memory rules (``profile.release``: an activation freed at its I or
at its W), full and split backward, and the early stop at a makespan bound."""

from __future__ import annotations

import math
import random

import pytest

from titan_ext.plan import LinkProfile, PipelineProfile
from titan_ext.plan import deps, pipemorph

C = pipemorph._GENERATE_C
pytestmark = pytest.mark.skipif(C is None, reason="titan_ext.plan._pipemorph_c is not built")


def _case(rng: random.Random) -> tuple:
    S = rng.randint(1, 9)
    N = rng.randint(1, 4 * S)
    times = lambda lo: tuple(round(rng.uniform(lo, 12.0), 3) for _ in range(S))  # noqa: E731
    links = tuple(LinkProfile(latency_ms=rng.choice([0.0, 0.0, round(rng.uniform(0, 40), 3)]),
                              bandwidth_bytes_per_s=rng.choice([math.inf, math.inf, rng.uniform(0.5e9, 8e9)]),
                              message_bytes=rng.uniform(1e6, 64e6))
                  for _ in range(S - 1))
    prof = PipelineProfile(S, N, times(0.5), times(0.5), times(0.0), links, release=rng.choice(["I", "W"]))
    x = sorted((rng.randint(1, N) for _ in range(S)), reverse=True)  # warm-up counts do not grow with i
    limit = [rng.choice([v, rng.randint(v, N)]) for v in x]  # capped at x_i or above
    return prof, x, limit, rng.random() < 0.3


def test_compiled_generator_is_bit_identical_to_the_python_reference():
    rng = random.Random(20261125)
    stopped = bound_cases = 0
    deadlocks = 0
    for _ in range(400):
        prof, x, limit, full = _case(rng)
        try:
            ref = pipemorph._generate_py(prof, x, limit, full)
        except ValueError as exc:  # random caps can starve a stage: both refuse, with the same message
            with pytest.raises(ValueError, match="deadlock") as err:
                pipemorph._generate(prof, x, limit, full)
            assert str(err.value) == str(exc)
            deadlocks += 1
            continue
        assert pipemorph._generate(prof, x, limit, full) == ref
        # the early stop: a bound below, at and above the makespan
        for bound in (ref[1] - rng.randint(1, max(1, ref[1])), ref[1], ref[1] + 1):
            bound_cases += 1
            got = pipemorph._generate(prof, x, limit, full, bound)
            assert got == pipemorph._generate_py(prof, x, limit, full, bound)
            stopped += got[0] is None
    assert stopped > 50 and bound_cases - stopped > 50 and deadlocks < 200  # every outcome was exercised


def test_a_plan_made_with_the_compiled_generator_equals_the_reference_plan(monkeypatch):
    """Through the public planner: the same plan, warm-up counts and makespan either way."""
    links = tuple(LinkProfile() for _ in range(6)) + (LinkProfile(latency_ms=60.0),)
    prof = PipelineProfile(8, 32, (10.0,) * 8, (10.0,) * 8, (10.0,) * 8, links)
    fast = pipemorph.plan_pipemorph(prof)
    monkeypatch.setattr(pipemorph, "_GENERATE_C", None)
    slow = pipemorph.plan_pipemorph(prof)
    assert fast.ops == slow.ops and fast.warmup_counts == slow.warmup_counts
    assert fast.predicted_makespan_ms == slow.predicted_makespan_ms == 1090.0  # T_ideal + c


def test_compiled_checks_give_the_python_validators_verdict_and_peaks():
    """validate.py checks 1-3, compiled (the hot path) vs in Python (the reference that names the reason),
    on valid plans and plans broken the ways test_plan_candidates' torch agreement fuzz breaks them."""
    from _plan_cases import mutate as _mutate  # the same breakages that fuzz checks against torch (test_plan_candidates.py)

    from titan_ext.plan.simulate import peak_inflight
    from titan_ext.plan.validate import PlanValidationError, _check_python

    rng = random.Random(7)
    verdicts = {True: 0, False: 0}
    for _ in range(600):
        S = rng.randint(1, 5)
        N = rng.randint(1, 2 * S)
        release = rng.choice(["I", "W"])
        prof = PipelineProfile(S, N, [rng.uniform(1, 5) for _ in range(S)], [rng.uniform(1, 5) for _ in range(S)],
                               [rng.uniform(0, 5) for _ in range(S)], release=release)
        x = sorted((rng.randint(1, N) for _ in range(S)), reverse=True)
        base = pipemorph.generate_order(prof, x, rng.choice([None, x]), full_backward=rng.random() < 0.25).order
        _, ops, limit = _mutate(rng, base, S) if S > 1 else ("valid", base, None)
        if rng.random() < 0.1:  # out-of-range and foreign stages too
            ops[0] = ops[0] + [rng.choice([(0, "F", N), (S, "F", 0), (0, "W", N + 3)])]
        peaks = C.check(deps.table(S).spec(), ops, S, N, limit, release == "W")
        try:
            _check_python(ops, S, N, limit, False, release)
            ok = True
        except PlanValidationError:
            ok = False
        assert (peaks is not None) == ok, (ops, limit)
        if ok:
            assert peaks == list(peak_inflight(ops, release).values())
        verdicts[ok] += 1
    assert min(verdicts.values()) > 100, verdicts


def test_compiled_virtual_generator_is_bit_identical_to_the_python_reference():
    """virtual._virtual_loop (compiled) vs _virtual_loop_py: loop and V placements, 1-3 stages per rank,
    heterogeneous stages, bandwidth-limited rank links shared by the chunks of a V (one FIFO channel per
    rank pair and direction), in-flight caps."""
    from titan_ext.plan import virtual

    rng = random.Random(99)
    for _ in range(200):
        R, V = rng.randint(1, 5), rng.randint(1, 3)
        placement = rng.choice(["loop", "v"]) if V == 2 else "loop"
        s2r = list(virtual.virtual_stage_to_rank(R, V, placement))
        S, N = R * V, rng.randint(1, 3 * R * V)
        times = lambda: [round(rng.uniform(0.5, 9), 3) for _ in range(S)]  # noqa: E731
        links = tuple(LinkProfile(latency_ms=rng.choice([0.0, round(rng.uniform(0, 30), 3)]),
                                  bandwidth_bytes_per_s=rng.choice([math.inf, rng.uniform(1e9, 8e9)]),
                                  message_bytes=rng.uniform(1e6, 32e6)) for _ in range(S - 1))
        prof = PipelineProfile(S, N, times(), times(), times(), links, release=rng.choice(["I", "W"]))
        limit = [rng.randint(1, N) for _ in range(S)]
        x = [min(rng.randint(1, N), limit[s], min(limit[:s] or [N])) for s in range(S)]
        ref = virtual._virtual_loop_py(prof, s2r, x, limit)
        assert virtual._virtual_loop(prof, s2r, x, limit) == ref
