"""The plan contract: one result type from every planner, one by-name dispatch,
one placement model, the profile's JSON format, the literal Alg.2 candidate.

References are independent of the code under test: torch's own stage→rank mapping and validator,
the reference simulator, counts recomputed here by brute force from the plan's operations, and the
paper's Alg.2 formula written out here."""

import json
import math
import random

import pytest

from titan_ext.plan import LinkProfile, PipelineProfile, PlanResult, generate_order, simulate, validate_plan
from titan_ext.plan.ir import as_ops
from titan_ext.plan.placement import (
    boundary_link,
    rank_profile,
    rank_stages,
    read_placement,
    stage_profile,
    stage_to_rank,
)
from titan_ext.plan.schedules import BUILTIN_SCHEDULES, CROSSPIPE_SCHEDULES, SCHEDULE_NAMES, plan_by_name

PROFILE = PipelineProfile(4, 12, (10.0, 12.0, 9.0, 11.0), (10.0, 11.0, 10.0, 9.0), (5.0, 6.0, 4.0, 5.0),
                          (LinkProfile(), LinkProfile(30.0, 1e9, 2e6), LinkProfile()))

CASES = [(name, {}) for name in SCHEDULE_NAMES if name != "optimal"] + [
    ("optimal", {"time_limit_s": 20.0}),
    ("pipemorph", {"virtual_stages": 2, "placement": "loop"}),
    ("pipemorph", {"virtual_stages": 2, "placement": "v"}),
    ("crosspipe-wave", {"virtual_stages": 2, "placement": "v"}),
    ("auto", {"memory_limit": 5}),
    ("pipemorph", {"backward": "full"}),
]


def _brute_counts(ops, s2r):
    """(x per stage, in-flight peak per stage, per-rank peak in whole-rank activations), counted here."""
    x, peak, rank_peak = {}, {}, {}
    for rank, rank_ops in ops.items():
        held, seen_b, mine = {}, set(), [s for s, r in enumerate(s2r) if r == rank]
        total = top = 0
        for s, kind, _ in rank_ops:
            if kind == "F":
                if s not in seen_b:
                    x[s] = x.get(s, 0) + 1
                held[s] = held.get(s, 0) + 1
                peak[s] = max(peak.get(s, 0), held[s])
                total += 1
            elif kind in ("I", "B"):
                seen_b.add(s)
                held[s] -= 1
                total -= 1
            top = max(top, total)
        rank_peak[rank] = top / len(mine)
    return [x[s] for s in sorted(x)], peak, rank_peak


@pytest.mark.parametrize("name,kw", CASES, ids=[f"{n}-{'-'.join(map(str, k.values()))}" for n, k in CASES])
def test_every_planner_returns_the_contract(name, kw):
    if name == "optimal":
        pytest.importorskip("ortools")
    res = plan_by_name(PROFILE, name, **kw)
    assert isinstance(res, PlanResult) and res.schedule == name and res.source and res.plan_ms > 0
    ops = as_ops(res.actions)
    assert ops == res.ops
    S = len(res.stage_to_rank)
    assert all(res.stage_to_rank[s] == r for r, rank_ops in ops.items() for s, _, _ in rank_ops)
    validate_plan(ops, S, PROFILE.num_microbatches, torch_dry_run=True)  # torch's lowering + dry run
    x, peak, rank_peak = _brute_counts(ops, res.stage_to_rank)
    if not (name == "pipemorph" and not kw.get("virtual_stages")) and name != "auto":
        assert res.warmup_counts == x  # read off the plan (PipeMorph's are its planned x_i, checked below)
    assert len(res.warmup_counts) == S
    assert res.peak_inflight == peak and res.peak_memory_per_rank == pytest.approx(rank_peak)
    V = S // PROFILE.num_stages
    assert res.peak_memory_per_stage == pytest.approx({s: p / V for s, p in peak.items()})
    timeline = simulate(res.actions, res.profile, stage_to_rank=dict(enumerate(res.stage_to_rank)))
    if name == "optimal":  # the solver's times are one feasible timing of its order: never below ours
        assert timeline.makespan_ms <= res.predicted_makespan_ms + 1e-6
    else:
        assert timeline.makespan_ms == pytest.approx(res.predicted_makespan_ms, abs=1e-6)
    if "memory_limit" in kw:
        assert max(res.peak_memory_per_rank.values()) <= kw["memory_limit"]
    json.dumps(res.summary(), allow_nan=False)  # strict JSON, as the CLI prints it


def test_one_memory_limit_check_for_every_name():
    for name in ("pipemorph", "auto", "crosspipe-ud", "crosspipe-wave", "1F1B"):
        for bad in (0, -1, True, math.nan):
            with pytest.raises(ValueError, match="memory_limit must be >= 1 activation"):
                plan_by_name(PROFILE, name, memory_limit=bad)
    with pytest.raises(ValueError, match="stage_memory_limit"):
        plan_by_name(PROFILE, "pipemorph", virtual_stages=2, stage_memory_limit=0)
    with pytest.raises(ValueError, match="whole number"):
        plan_by_name(PROFILE, "crosspipe-ud", memory_limit=4.5)
    with pytest.raises(ValueError, match="schedule must be one of"):
        plan_by_name(PROFILE, "nope")
    with pytest.raises(ValueError, match="split backwards only"):
        plan_by_name(PROFILE, "crosspipe-ud", backward="full")
    # torch's built-in is what it is: refused (not silently kept) above the limit
    with pytest.raises(ValueError, match="above the memory limit"):
        plan_by_name(PROFILE, "GPipe", memory_limit=3)
    assert set(CROSSPIPE_SCHEDULES) | set(BUILTIN_SCHEDULES) <= set(SCHEDULE_NAMES)


# ----------------------------------------------------------------------------- placement
@pytest.mark.parametrize("R", [1, 2, 3, 5])
@pytest.mark.parametrize("V", [1, 2, 3])
def test_stage_to_rank_is_torchs_mapping(R, V):
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    for placement in ("loop", "v"):
        if placement == "v" and V != 2:
            continue  # torch's style "v" is defined for two stages per rank
        want = generate_stage_to_rank_mapping(R, R * V, style=placement)
        assert stage_to_rank(R, V, placement) == tuple(want[s] for s in range(R * V))
    s2r = stage_to_rank(R, V, "loop")
    assert all(rank_stages(s2r, r) == list(range(r, R * V, R)) for r in range(R))
    assert read_placement(s2r) == "loop"


def test_boundary_links_and_profiles_round_trip():
    s2r = stage_to_rank(3, 2, "loop")  # 0 1 2 0 1 2: the wrap-around 2 → 3 joins ranks 2 and 0
    assert [boundary_link(s2r, b) for b in range(5)] == [0, 1, None, 0, 1]
    v = stage_to_rank(3, 2, "v")  # 0 1 2 2 1 0: the turn 2 → 3 stays on rank 2
    assert [boundary_link(v, b) for b in range(5)] == [0, 1, None, 1, 0] and read_placement(v) == "v"
    with pytest.raises(ValueError, match="neither looped nor V-shaped"):
        read_placement((0, 1, 0, 1, 1, 0))
    ranks = PipelineProfile(3, 12, (6.0, 8.0, 4.0), (6.0, 2.0, 8.0), (2.0, 4.0, 6.0),
                            (LinkProfile(10.0), LinkProfile(3.0, 1e9, 1e6)), activation_bytes=2.0,
                            memory_budget_bytes=20.0)
    for s2r in (stage_to_rank(3, 2, "loop"), v, stage_to_rank(3, 4, "loop")):
        staged = stage_profile(ranks, s2r)
        V = len(s2r) // 3
        assert staged.f_ms == tuple(ranks.f_ms[r] / V for r in s2r)
        assert staged.max_inflight() == tuple(ranks.max_inflight()[r] for r in s2r)  # budget split like memory
        assert [staged.links[b] for b in range(len(s2r) - 1)] == [
            LinkProfile() if boundary_link(s2r, b) is None else ranks.links[boundary_link(s2r, b)]
            for b in range(len(s2r) - 1)]
        back = rank_profile(staged, s2r)
        assert back.f_ms == pytest.approx(ranks.f_ms) and back.w_ms == pytest.approx(ranks.w_ms)
        assert back.links == ranks.links
    assert stage_profile(ranks, (0, 1, 2)) is ranks


# ----------------------------------------------------------------------------- profile JSON
def test_profile_json_round_trip_and_errors():
    p = PipelineProfile(3, 6, (1.0, 2.0, 3.0), 2.0, 0.5, (LinkProfile(5.0), LinkProfile(1.0, 1e9, 4e6)),
                        activation_bytes=1.0, memory_budget_bytes=4.0)
    assert PipelineProfile.from_json(json.loads(json.dumps(p.to_json()))) == p
    assert PipelineProfile.from_json({"num_stages": 2, "num_microbatches": 4, "f_ms": 1, "b_ms": 1,
                                      "w_ms": 1}).links == (LinkProfile(),)  # no links: no delay
    for doc, msg in (({"num_stages": 2}, "missing field"), ([], "JSON object"), ({**p.to_json(), "x": 1}, "unknown"),
                     ({**p.to_json(), "links": [{"latency": 1}, {}]}, r"links\[0\]: unknown"),
                     ({**p.to_json(), "links": [{}]}, "1 entries for 3 stages")):
        with pytest.raises(ValueError, match=msg):
            PipelineProfile.from_json(doc)


# ----------------------------------------------------------------------------- literal Alg.2 (item 5)
def test_never_behind_the_papers_literal_alg2():
    """PipeMorph Alg.2 as published clips Δ_i at N − 2S: at N = 2S every Δ_i = 0, so x_i = 1 everywhere,
    generated without an in-flight cap. Our plan (whatever candidate wins) is never slower than it."""
    rng = random.Random(25)
    for _ in range(12):
        S = rng.choice((3, 4, 6))
        prof = PipelineProfile(S, 2 * S, [rng.uniform(5, 15) for _ in range(S)], [rng.uniform(5, 15) for _ in range(S)],
                               [rng.uniform(2, 10) for _ in range(S)]).with_delays({rng.randrange(S - 1): rng.uniform(10, 90)})
        literal = simulate(generate_order(prof, [1] * S).order, prof).makespan_ms
        res = plan_by_name(prof, "pipemorph")
        assert "alg2-literal" in res.candidates  # tried (or pruned as certainly slower)
        assert simulate(res.actions, prof).makespan_ms <= literal + 1e-9
