"""The parts of several-stages-per-rank run time that need no process group (runtime/decide/placement.py,
the per-stage block of the profile vector).  The multi-process tests are in test_runtime_multistage.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from titan_ext.plan import LinkProfile, PipelineProfile
from titan_ext.plan.virtual import virtual_profile
from titan_ext.runtime.decide.placement import VirtualEstimator, VirtualReplanPolicy, rank_level, read_layout
from titan_ext.runtime.measure.profiler import (ActionRecord, IterationProfile, decode_profiles, encode_profile,
                                               profile_length)

R, V, N = 4, 2, 8


def _layout(placement: str):
    local = {"loop": [1, 5], "v": [1, 6]}[placement]
    return read_layout(local, 1, R, R * V)


@pytest.mark.parametrize("placement", ["loop", "v"])
def test_rank_level_inverts_the_plan_layers_stage_profile(placement):
    rank = PipelineProfile(R, N, (4.0, 6.0, 8.0, 2.0), (3.0, 5.0, 7.0, 1.0), (2.0, 2.0, 2.0, 2.0),
                           tuple(LinkProfile(latency_ms=d) for d in (5.0, 60.0, 0.5)))
    stage, _ = virtual_profile(rank, V, placement)
    back, times = rank_level(stage, _layout(placement))
    assert back.delays_ms == rank.delays_ms
    for got, want in zip((back.f_ms, back.b_ms, back.w_ms), (rank.f_ms, rank.b_ms, rank.w_ms)):
        assert got == pytest.approx(want)
    assert times == (stage.f_ms, stage.b_ms, stage.w_ms)


@pytest.mark.parametrize("placement", ["loop", "v"])
def test_estimator_gives_the_stage_profile_of_the_measured_rank_links(placement):
    layout = _layout(placement)
    S = R * V
    f = [1.0 + s for s in range(S)]
    i = [2.0 + s for s in range(S)]
    w = [0.5 * s for s in range(S)]
    delays = [3.0, 45.0, 0.0]
    ranks = [SimpleNamespace(gap_ms=math.nan, stage_ms=[(f[s], i[s], w[s], math.nan) for s in layout.local_stages(r)])
             for r in range(R)]
    est = VirtualEstimator(layout, N, window=3)
    for _ in range(2):
        est.push(ranks, delays)
    got = est.profile()
    rank = PipelineProfile(R, N, (1.0,) * R, (1.0,) * R, (1.0,) * R, tuple(LinkProfile(latency_ms=d) for d in delays))
    want, _ = virtual_profile(rank, V, placement, stage_times_ms=(f, i, w))
    assert got.f_ms == pytest.approx(want.f_ms) and got.b_ms == pytest.approx(want.b_ms)
    assert got.w_ms == pytest.approx(want.w_ms)
    assert got.delays_ms == pytest.approx(want.delays_ms)
    assert est.rank_link_delays_ms() == delays


def test_estimator_plans_a_full_backward_stage_with_its_measured_b():
    layout = _layout("loop")
    ranks = [SimpleNamespace(gap_ms=math.nan, stage_ms=[(1.0, math.nan, math.nan, 7.0)] * V) for _ in range(R)]
    est = VirtualEstimator(layout, N, window=3)
    est.push(ranks, [0.0] * (R - 1))
    prof = est.profile()
    assert prof.b_ms == (7.0,) * (R * V) and prof.w_ms == (0.0,) * (R * V)


def test_policy_adapts_to_a_delay_and_back_but_not_to_jitter():
    layout = _layout("v")
    base = PipelineProfile(R, N, (5.0,) * R, (5.0,) * R, (5.0,) * R, (LinkProfile(),) * (R - 1))
    stage = lambda d, t=1.0: virtual_profile(base.with_delays({1: d}), V, "v",  # noqa: E731
                                             stage_times_ms=tuple([2.5 * t] * (R * V) for _ in range(3)))[0]
    policy = VirtualReplanPolicy(layout=layout)
    decide = lambda p: policy.decide(p, [1] * (R * V), [1] * (R * V), 5).action  # noqa: E731
    assert decide(stage(0.2)) == "keep"  # first measurement: the reference
    assert decide(stage(0.8, 1.08)) == "keep"  # jitter: below the margins
    assert decide(stage(60.0)) == "adapt"
    assert decide(stage(63.0)) == "keep"  # 5 % of 63 ms: within rel_margin
    assert decide(stage(60.0, 1.5)) == "adapt"  # a 50 % slower rank period
    assert decide(stage(0.5, 1.5)) == "adapt"  # recovery re-plans too


def test_profile_vector_carries_one_row_per_local_stage():
    prof = IterationProfile()
    for s, kind, ms in ((1, "F", 2.0), (1, "F", 4.0), (6, "F", 8.0), (6, "I", 3.0), (1, "W", 1.0)):
        rec = ActionRecord(kind, s, 0, start=0.0, end=ms / 1e3)
        prof.actions.append(rec)
    rows = prof.stage_times_ms([1, 6])
    vec = encode_profile(prof, 0, 0, 2 * N, math.nan, math.nan, stage_ms=rows)
    # the length the exchange's early-posted receives are made for (ControlPlane.expect), with and without rows
    assert vec.numel() == profile_length(2 * N, local_stages=2)
    assert encode_profile(prof, 0, 0, 2 * N, math.nan, math.nan).numel() == profile_length(2 * N)
    (dec,) = decode_profiles([vec], 2 * N, local_stages=2)
    assert dec.stage_ms[0][0] == pytest.approx(3.0) and dec.stage_ms[0][2] == pytest.approx(1.0)
    assert math.isnan(dec.stage_ms[0][1]) and math.isnan(dec.stage_ms[0][3])
    assert dec.stage_ms[1][:2] == pytest.approx([8.0, 3.0])
    assert dec.f_ms == pytest.approx(4.0)  # the rank-level header is unchanged (median of all F)


@pytest.mark.parametrize("placement", ["loop", "v"])
def test_split_backward_planning_leaves_out_full_backward_plans(placement):
    from titan_ext.plan.ir import as_ops
    from titan_ext.plan.virtual import plan_virtual

    rank = PipelineProfile(R, 16, (10.0,) * R, (10.0,) * R, (10.0,) * R,
                           (LinkProfile(), LinkProfile(), LinkProfile(latency_ms=60.0)))
    every = plan_virtual(rank, V, placement, validate=False)
    split = plan_virtual(rank, V, placement, validate=False, full_backward=False)
    full_names = {"loop": "torch:Interleaved1F1B", "v": "torch:DualPipeV"}[placement]
    assert full_names in every.candidates and full_names not in split.candidates
    assert not any(k == "B" for ops in as_ops(split.actions).values() for _, k, _ in ops)
