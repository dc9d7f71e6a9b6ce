"""CrossPipe greedy generator (CrossPipe §4.2, Alg.1): validity, timing model, comparisons with torch's
own static schedules and our zb plans.

References are independent of the generator: torch's built-in schedules (taken from torch, simulated by
the planning core's simulator), the planning core's PipeMorph/zb plans, closed forms derived below.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from titan_ext.plan import LinkProfile, PipelineProfile, plan_pipemorph, simulate, validate_plan
from titan_ext.plan.timing import LinkQueues, to_ns
from titan_ext.plan.crosspipe import (
    greedy_schedule,
    plan_crosspipe,
    plan_crosspipe_placed,
    wave_stage_to_rank,
)

from _plan_cases import RATIOS, N, S, link, placed, rank_peaks, ud_profile, uniform_placed, wave_profile


@pytest.fixture(scope="module")
def builtins():
    from titan_ext.plan.builtin import builtin_plan

    f1b, _ = builtin_plan("1F1B", S, N)
    zbv, zbv_s2r = builtin_plan("ZBVZeroBubble", S, N)
    assert [zbv_s2r[s] for s in range(2 * S)] == list(wave_stage_to_rank(S))
    return f1b, zbv, zbv_s2r


# ----------------------------------------------------------------------------- Must show
@pytest.mark.parametrize("lat,bw", RATIOS)
def test_crossud_beats_1f1b_and_zb_at_their_memory(lat, bw, builtins):
    """CrossUD ≤ torch's 1F1B and ≤ our zb / zb-h1 plans, each at its counterpart's activation memory
    (per-stage peak in-flight of the static plan); with no delay within 5 %."""
    f1b, _, _ = builtins
    prof = ud_profile(lat, bw)
    statics = {"1F1B": f1b}
    for name in ("zb", "zb-h1"):
        statics[name] = plan_pipemorph(prof, schedule=name).actions
    for name, actions in statics.items():
        ref = simulate(actions, prof)
        limit = [ref.peak_inflight[s] for s in range(S)]
        plan = plan_crosspipe(prof, "ud", memory_limit=limit)  # validated inside
        validate_plan(plan.actions, S, N, inflight_limit=limit)
        got = simulate(plan.actions, prof)
        assert got.makespan_ms == pytest.approx(plan.makespan_ms)
        assert all(got.peak_inflight[s] <= limit[s] for s in range(S))
        if lat == 0 and bw == 0:
            assert got.makespan_ms <= 1.05 * ref.makespan_ms, name
        else:
            assert got.makespan_ms <= ref.makespan_ms + 1e-6, (name, got.makespan_ms, ref.makespan_ms)


@pytest.mark.parametrize("lat,bw", RATIOS)
def test_crosswave_beats_zbv_at_its_memory(lat, bw, builtins):
    """CrossWave ≤ torch's ZBV at ZBV's per-rank activation peak; within 5 % with no delay."""
    _, zbv, zbv_s2r = builtins
    prof = wave_profile(lat, bw)
    ref = simulate(zbv, prof, stage_to_rank=zbv_s2r)
    limit = rank_peaks(zbv)
    plan = plan_crosspipe(prof, "wave", memory_limit=limit)
    got = simulate(plan.actions, prof, stage_to_rank=zbv_s2r)
    assert got.makespan_ms == pytest.approx(plan.makespan_ms)
    assert all(p <= lim for p, lim in zip(rank_peaks(plan.actions), limit))
    if lat == 0 and bw == 0:
        assert got.makespan_ms <= 1.05 * ref.makespan_ms
    else:
        assert got.makespan_ms <= ref.makespan_ms + 1e-6, (got.makespan_ms, ref.makespan_ms)


def test_udsub_never_worse_than_ud():
    for lat, bw in RATIOS:
        prof = ud_profile(lat, bw)
        limit = [S - s for s in range(S)]
        ud = plan_crosspipe(prof, "ud", memory_limit=limit, validate=False)
        sub = plan_crosspipe(prof, "udsub", memory_limit=limit)
        assert simulate(sub.actions, prof).makespan_ms <= simulate(ud.actions, prof).makespan_ms + 1e-6


# ----------------------------------------------------------------------------- closed forms
@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8), (8, 32)])
def test_uniform_no_delay_reaches_the_last_stage_bound(stages, micro):
    """F = B = W = t, no delay, 1F1B memory (S − s): the last stage cannot start before (S−1)·t and has
    3N·t of work, so T ≥ (S−1)t + 3Nt; CrossUD reaches it (as ZB-H1 does)."""
    t = 10.0
    prof = PipelineProfile(stages, micro, t, t, t)
    plan = plan_crosspipe(prof, "ud", memory_limit=[stages - s for s in range(stages)])
    assert simulate(plan.actions, prof).makespan_ms == pytest.approx((stages - 1) * t + 3 * micro * t)


def test_memory_one_serialises_microbatches():
    """Limit 1 on every stage: microbatch m+1 enters only after microbatch m's I left stage 0, so
    T = 2SN·t + t (the last W); derived by hand, see tests/plan/test_crosspipe_optimal.py."""
    t = 10.0
    for stages, micro in ((2, 3), (3, 4)):
        prof = PipelineProfile(stages, micro, t, t, t)
        plan = plan_crosspipe(prof, "ud", memory_limit=1)
        assert simulate(plan.actions, prof).makespan_ms == pytest.approx(2 * stages * micro * t + t)


# ----------------------------------------------------------------------------- model & mechanics
def test_link_occupancy_is_fifo_and_equals_range_based_on_one_sender():
    """The greedy sends through ``timing.LinkQueues`` (FIFO per direction). §4.2.3's range-based occupancy
    (earliest free window of its length at or after the ready time) gives the same arrivals whenever the
    ready times per channel never decrease — what one sender per channel, sending at the ends of its
    operations, produces (crosspipe.greedy's docstring)."""
    import bisect

    def range_based(windows, ready, length):  # the reservation as published, for comparison
        starts, ends = windows.setdefault("s", []), windows.setdefault("e", [])
        i, t = bisect.bisect_right(ends, ready), ready
        while i < len(starts) and t + length > starts[i]:
            t = max(t, ends[i])
            i += 1
        starts.insert(i, t)
        ends.insert(i, t + length)
        return t + length

    ms = 1_000_000  # ns
    links = LinkQueues([link(3.0, 2.0)])
    assert links.send(0, (0, 1), 0) == 5 * ms  # window [0, 2), +3 latency
    assert links.send(0, (0, 1), 1 * ms) == 7 * ms  # FIFO: after [0, 2)
    assert links.send(0, (0, 1), 9 * ms) == 14 * ms  # idle channel
    assert links.send(0, (1, 0), 0) == 5 * ms  # other direction is independent
    rng = random.Random(3)
    for _ in range(200):
        fifo, windows, ready = LinkQueues([link(0.5, rng.uniform(0.1, 3))]), {}, 0
        for _ in range(30):
            ready += rng.choice([0, rng.randint(0, 4 * ms)])
            assert fifo.send(0, "c", ready) == range_based(windows, ready, fifo.transfer_ns[0]) + ms // 2


def test_bandwidth_queues_messages_latency_does_not():
    """Two messages sent back to back: with size·β = 30 ms the second waits for the first; with a
    30 ms latency both travel at once (the α-β model of CrossPipe §2.2)."""
    t = 10.0
    order = {
        0: [(0, "F", 0), (0, "F", 1), (0, "I", 0), (0, "W", 0), (0, "I", 1), (0, "W", 1)],
        1: [(1, "F", 0), (1, "F", 1), (1, "I", 0), (1, "W", 0), (1, "I", 1), (1, "W", 1)],
    }

    def starts(**link_ms):
        prof = placed((0, 1), 2, (t, t), (t, t), (t, t), **link_ms).profile
        return {(e.stage, e.kind, e.microbatch): e.start_ms for e in simulate(order, prof).events}

    bw, lat = starts(transfer=(30.0,)), starts(latency=(30.0,))
    # F(0,0) ends 10, F(0,1) ends 20; bandwidth: arrivals 40 and 70; latency: 40 and 50
    assert bw[(1, "F", 0)] == 40.0 and lat[(1, "F", 0)] == 40.0
    assert bw[(1, "F", 1)] == 70.0 and lat[(1, "F", 1)] == 50.0
    # the greedy sends the same way: its plan's own timing is the simulator's
    for kw in ({"transfer": (30.0,)}, {"latency": (30.0,)}):
        problem = placed((0, 1), 2, (t, t), (t, t), (t, t), **kw)
        g = greedy_schedule(problem)
        assert g.makespan_ns == to_ns(simulate(g.orders, problem.profile).makespan_ms)


def test_subblocks_split_w_only():
    """Every W runs as n_sub sub-blocks adding up to its time exactly (integer ns: 2 ms / 4 = 0.5 ms
    each; 1 ms + 1 ns / 3: the first sub-block one ns longer); F and I run whole."""
    for w_ms, n_sub, expect in ((2.0, 4, [500_000] * 4), (1.000001, 3, [333_334, 333_334, 333_333])):
        prob = uniform_placed(4, 8, 1.0, 1.0, w_ms, latency_ms={1: 1.5})
        g = greedy_schedule(prob, n_sub=n_sub)
        per_op: dict = {}
        for _, op, idx, t0, t1 in g.subblocks:
            per_op.setdefault(op, []).append((idx, t1 - t0))
        for op, parts in per_op.items():
            if op[1] == "W":
                assert [d for _, d in sorted(parts)] == expect
                assert sum(expect) == to_ns(w_ms)
            else:
                assert len(parts) == 1


def test_replay_matches_core_simulator_on_random_cases():
    """Our replay and the planning core's simulate are two implementations of one timing model."""
    rng = random.Random(7)
    for _ in range(30):
        ranks = rng.randint(2, 6)
        micro = rng.randint(ranks, 3 * ranks)
        wave = rng.random() < 0.4
        stages = 2 * ranks if wave else ranks
        micro = max(micro, stages)
        links = tuple(
            LinkProfile(latency_ms=rng.choice([0, 0, 3, 12.5]), bandwidth_bytes_per_s=1e9, message_bytes=rng.choice([0, 5e6, 2e7]))
            for _ in range(stages - 1)
        )
        prof = PipelineProfile(
            stages, micro, [rng.uniform(2, 12) for _ in range(stages)], [rng.uniform(2, 12) for _ in range(stages)],
            [rng.uniform(0, 12) for _ in range(stages)], links,
        )
        plan = plan_crosspipe(prof, "wave" if wave else rng.choice(["ud", "udsub"]), validate=False)
        sim = simulate(plan.actions, prof)
        assert to_ns(sim.makespan_ms) == plan.makespan_ns  # integer ns on both sides: equal, not close


def test_validity_fuzz():
    """Random heterogeneous cases with delays and memory limits: every variant's plan passes the
    validator (torch lowering + dry run) and respects its memory limit."""
    rng = random.Random(2026)
    for i in range(45):
        ranks = rng.randint(1, 8)
        wave = i % 3 == 2 and ranks >= 1
        variant = "wave" if wave else ("ud", "udsub")[i % 3]
        stages = 2 * ranks if wave else ranks
        micro = rng.randint(stages, stages + 12)
        prob = placed(
            wave_stage_to_rank(ranks) if wave else tuple(range(ranks)), micro,
            f=tuple(rng.uniform(1, 10) for _ in range(stages)),
            b=tuple(rng.uniform(1, 10) for _ in range(stages)),
            w=tuple(rng.uniform(0, 10) for _ in range(stages)),
            latency=tuple(rng.choice([0.0, 2.0, 25.0]) for _ in range(stages - 1)),
            transfer=tuple(rng.choice([0.0, 1.0, 15.0]) for _ in range(stages - 1)),
            memory_limit=tuple(float(rng.randint(2 if wave else 1, 2 * stages)) for _ in range(ranks)),
        )
        plan = plan_crosspipe_placed(prob, variant)
        per_stage = None if wave else [int(x) for x in prob.memory_limit]
        validate_plan(plan.actions, stages, micro, inflight_limit=per_stage)
        assert all(p <= lim + 1e-9 for p, lim in zip(rank_peaks(plan.actions), prob.memory_limit))
        assert to_ns(simulate(plan.orders, prob.profile).makespan_ms) == plan.makespan_ns


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="memory_limit"):
        uniform_placed(3, 4, 1, 1, 1, wave=True, memory_limit=1)  # two stages need 2
    with pytest.raises(ValueError, match="n_sub"):
        greedy_schedule(uniform_placed(2, 2, 1, 1, 1), n_sub=0)
    with pytest.raises(ValueError, match="share no link"):
        placed((0, 2, 1), 3, (1, 1, 1), (1, 1, 1), (1, 1, 1))
    with pytest.raises(TypeError, match="PlacedProfile"):
        greedy_schedule(PipelineProfile(2, 2, 1, 1, 1))
    with pytest.raises(ValueError, match="wave"):
        plan_crosspipe(PipelineProfile(3, 4, 1, 1, 1), "wave")
    with pytest.raises(ValueError, match="variant"):
        plan_crosspipe(PipelineProfile(3, 4, 1, 1, 1), "loop")


@pytest.mark.multiprocess
def test_import_stays_light():
    code = (
        "import sys, titan_ext.plan, titan_ext.plan.crosspipe, titan_ext.plan.optimal, titan_ext.plan.schedules;"
        "bad = [m for m in ('torch', 'ortools') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
