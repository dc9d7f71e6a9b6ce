"""Re-planning policy (Eq.1 tolerance, hysteresis) and the profiler's link-delay estimator, against
closed forms — no process group needed."""

from __future__ import annotations

import math

import random

import pytest

from titan_ext.plan import PipelineProfile, adapted_warmup_counts, initial_warmup_counts, link_tolerance_ms
from titan_ext.runtime import ReplanPolicy
from titan_ext.runtime.measure.profiler import RankProfile, link_delay_estimates, timeline_bubble_rate
from titan_ext.runtime.control.deploy import plan_hash, warmup_counts_of

S, N, T = 4, 16, 10.0


def _profile(delays: dict[int, float]) -> PipelineProfile:
    return PipelineProfile.uniform(S, N, T, T, T, delays_ms=delays)


def test_eq1_tolerance_closed_form_and_adapt_decision():
    initial = initial_warmup_counts(S, 2 * S - 1)  # Δ = 2 everywhere
    # Eq.1: c ≤ (Δ (tF + tB) − tF − tB)/2 = (2·20 − 20)/2 = 10 ms
    assert link_tolerance_ms(_profile({}), initial, 2) == pytest.approx(10.0)
    pol = ReplanPolicy()
    assert pol.decide(_profile({2: 10.5}), initial, initial, 5).action == "keep"  # within the margin
    d = pol.decide(_profile({2: 30.0}), initial, initial, 5)
    assert d.action == "adapt" and d.violated_links == [2] and d.mode == "adaptive"


def test_shrink_needs_sustained_recovery_and_hysteresis_prevents_flapping():
    initial = initial_warmup_counts(S, 2 * S - 1)
    pol = ReplanPolicy(recover_patience=3, min_dwell=2)
    adapted = adapted_warmup_counts(_profile({2: pol.headroom_delay(30.0)}))
    assert adapted[2] - adapted[3] > 2  # more slack on the slow link
    # still slow: keep the adapted plan
    assert pol.decide(_profile({2: 30.0}), adapted, initial, 5).action == "keep"
    # a single good check is not enough, nor two; the third consecutive one shrinks to Alg.1's plan
    actions = [pol.decide(_profile({2: 0.5}), adapted, initial, 5).action for _ in range(3)]
    assert actions == ["keep", "keep", "shrink"]
    # an interrupted recovery starts counting again
    pol2 = ReplanPolicy(recover_patience=3)
    seq = [0.5, 0.5, 30.0, 0.5, 0.5]
    assert [pol2.decide(_profile({2: c}), adapted, initial, 5).action for c in seq] == ["keep"] * 5

    # jitter straddling the adapt threshold (tol·1.1 + 1 ms = 12 ms, c = 12 ms ± 15 %): one adaptation,
    # then no oscillation between plans
    rng = random.Random(0)
    pol3 = ReplanPolicy()
    deployed, changes, above = list(initial), [], 0
    for step in range(60):
        c = 12.0 * (1 + rng.uniform(-0.15, 0.15))
        above += c > 12.0
        d = pol3.decide(_profile({2: c}), deployed, initial, 10)
        if d.action in ("adapt", "shrink"):
            changes.append(d.action)
            planning = _profile({2: pol3.headroom_delay(c)})
            deployed = adapted_warmup_counts(planning) if d.mode == "adaptive" else list(initial)
    assert above > 10  # the jitter does cross the threshold many times
    assert changes == ["adapt"], changes


def test_slack_limit_gives_hold_not_replan():
    S2, N2 = 4, 8  # N − 2S = 0: Alg.2 clips at the floor, nothing bigger exists
    prof = PipelineProfile.uniform(S2, N2, T, T, T, delays_ms={2: 60.0})
    x = adapted_warmup_counts(prof)
    assert ReplanPolicy().decide(prof, x, x, 5).action == "hold"


def _rank(sends_next=(), sends_prev=(), arrivals_prev=(), arrivals_next=(), offset=float("nan"),
          busy=0.0, first_f=float("nan"), last_end=float("nan")) -> RankProfile:
    return RankProfile(0, 0, 1, 1, 1, float("nan"), busy, first_f, first_f, last_end, 1.0, offset, 0.0, 0.0, 0,
                       list(sends_next), list(sends_prev), list(arrivals_prev), list(arrivals_next))


def test_link_delay_estimator_cancels_clock_offset():
    """Two ranks whose clocks differ by θ = 3.7 s; true one-way delay 30 ms each way, one late
    arrival stamp (+20 ms timer noise): the estimate is 30 ms, independent of θ."""
    theta, d = 3.7, 0.030
    sends0 = [10.0 + 0.05 * k for k in range(8)]  # rank 0 clock
    arr1 = [s + d + theta for s in sends0]  # rank 1 clock
    arr1[3] += 0.020
    sends1 = [20.0 + 0.05 * k for k in range(8)]  # rank 1 clock
    arr0 = [s + d - theta for s in sends1]
    r0 = _rank(sends_next=sends0, arrivals_next=arr0)
    r1 = _rank(sends_prev=sends1, arrivals_prev=arr1, offset=123.0)  # a wrong offset estimate: unused
    est = link_delay_estimates([r0, r1])
    assert est[0]["c_ms"] == pytest.approx(30.0, abs=1e-6)


def test_bubble_rate_closed_form():
    # 2 ranks, clocks offset by 5 s (known), each busy 60 ms over a 100 ms span → bubble 0.4
    r0 = _rank(busy=60.0, first_f=1.0, last_end=1.1)
    r1 = _rank(busy=60.0, first_f=6.02, last_end=6.09, offset=5.0)
    bubble, span = timeline_bubble_rate([r0, r1])
    assert span == pytest.approx(100.0)
    assert bubble == pytest.approx(0.4)


def test_plan_helpers():
    from titan_ext.plan import plan_pipemorph

    # Alg.1 as published (no candidates: with them a tie goes to the leaner 1F1B-like counts)
    plan = plan_pipemorph(_profile({}), mode="initial", memory_limit=7, candidates=False)
    assert warmup_counts_of(plan.actions) == plan.warmup_counts == [7, 5, 3, 1]
    other = plan_pipemorph(_profile({}), mode="initial", memory_limit=10, candidates=False)
    assert plan_hash(plan.actions) == plan_hash({r: list(a) for r, a in plan.actions.items()})
    assert plan_hash(plan.actions) != plan_hash(other.actions)


def test_a_link_under_the_absolute_margin_is_never_slow_even_at_a_negative_tolerance():
    """Stages of unequal speed give a plan a tolerance ≤ 0 on some link (Eq.1 solved for c): a reading of
    0.2 ms there is noise, not a straggler — re-planning on it was the healthy llama run's churn."""
    prof = PipelineProfile(4, 16, (2.0, 2.0, 9.0, 2.0), (2.0, 2.0, 9.0, 2.0), (2.0,) * 4).with_delays({2: 0.2})
    counts = [4, 3, 2, 1]
    assert link_tolerance_ms(prof, counts, 2) < 0
    assert ReplanPolicy().decide(prof, counts, counts, 5).action in ("keep", "hold")
    slow = prof.with_delays({2: 5.0})
    assert ReplanPolicy().decide(slow, counts, counts, 5).action == "adapt"


def test_the_model_keeps_the_running_backward_variant_within_the_margin():
    from types import SimpleNamespace as NS

    from titan_ext.runtime.decide.backward import faster_by_model

    split, full = NS(predicted_makespan_ms=100.0), NS(predicted_makespan_ms=101.0)
    assert faster_by_model(split, full, 0.02) is split  # first choice (none running): the faster, no margin
    assert faster_by_model(NS(predicted_makespan_ms=101.0), full, 0.02) is full  # a tie: full
    assert faster_by_model(NS(predicted_makespan_ms=101.5), full, 0.02, "mixed") is full
    assert faster_by_model(split, full, 0.02, "split") is split  # running split: full must win by it
    assert faster_by_model(NS(predicted_makespan_ms=97.0), full, 0.02, "full") is not full  # split won by 4 %
    assert faster_by_model(split, NS(predicted_makespan_ms=97.0), 0.02, "split").predicted_makespan_ms == 97.0


def test_the_executors_per_action_cost_makes_the_split_plan_pay_for_its_extra_action():
    """Without a delay and with the memory of GPipe, the split plan beats the full one by the model; planned
    with a per-action cost c (the estimator's planning profile) every action is c longer: the split plan
    (3 actions a microbatch) pays more than the full one (2 a microbatch), and at c = 2 ms the full plan wins."""
    from titan_ext.plan import PipelineProfile
    from titan_ext.plan.schedules import plan_by_name
    from titan_ext.plan.simulate import replay_makespan_ns
    from titan_ext.runtime.decide.backward import faster_by_model

    S, N = 4, 8
    prof = PipelineProfile(S, N, (1.0,) * S, (1.0,) * S, (1.0,) * S, release="W")

    def plans(c: float):
        return (plan_by_name(prof.with_action_cost([c] * S), "pipemorph", backward="split", mode="initial",
                             memory_limit=N),
                plan_by_name(prof.fused().with_action_cost([c] * S, full_backward=True), "pipemorph",
                             backward="full", mode="initial", memory_limit=N))

    split, full = plans(0.0)
    assert split.predicted_makespan_ms < full.predicted_makespan_ms * 0.98
    assert faster_by_model(split, full, 0.02) is split
    c = 2.0
    split_c, full_c = plans(c)
    assert faster_by_model(split_c, full_c, 0.02) is full_c
    # the full plan at this memory is GPipe's order: closed form (N + S − 1)(F + c) + (N + S − 1)(B + c)
    assert full.predicted_makespan_ms == (N + S - 1) * 1.0 + (N + S - 1) * 2.0
    assert full_c.predicted_makespan_ms == (N + S - 1) * (1.0 + c) + (N + S - 1) * (2.0 + c)
    # the split plan on F + c, I + c, W + c: its last stage runs all of its 3N actions in a row, so it grows
    # by at least 3N·c
    slow = PipelineProfile(S, N, (1.0 + c,) * S, (1.0 + c,) * S, (1.0 + c,) * S, release="W")
    assert split_c.predicted_makespan_ms >= split.predicted_makespan_ms + 3 * N * c - 1e-6
    assert replay_makespan_ns(split_c.ops, slow) / 1e6 == split_c.predicted_makespan_ms


def test_the_planning_profile_adds_each_ranks_measured_per_action_cost_to_its_stages():
    """One stage per rank: stage s pays rank s's gap; two stages per rank (loop): both pay their rank's;
    the compute-only profile (the metrics') is left as measured; no gap measured yet: no cost."""
    from types import SimpleNamespace as NS

    from titan_ext.runtime.measure.estimator import Estimator
    from titan_ext.runtime.decide.placement import VirtualEstimator, read_layout

    est = Estimator(3, 6, 3)
    assert est.planning_profile() == est.profile()  # nothing measured
    rows = [NS(f_ms=1.0, i_ms=2.0, w_ms=3.0, b_ms=4.0, gap_ms=g) for g in (0.1, 0.5, 0.2)]
    est.push(rows, [0.0, 0.0])
    split, full = est.planning_profile(), est.planning_profile("full")
    assert est.profile().f_ms == (1.0, 1.0, 1.0)
    assert split.f_ms == (1.1, 1.5, 1.2) and split.b_ms == (2.1, 2.5, 2.2) and split.w_ms == (3.1, 3.5, 3.2)
    assert full.f_ms == (1.1, 1.5, 1.2) and full.b_ms == (4.1, 4.5, 4.2) and full.w_ms == (0.0, 0.0, 0.0)
    layout = read_layout([0, 3], 0, 3, 6)  # rank 0 of 3 holds stages 0 and 3: the loop placement
    vest = VirtualEstimator(layout, 6, 3)
    vest.push([NS(gap_ms=g, stage_ms=[(1.0, 2.0, 3.0, 4.0)] * 2) for g in (0.1, 0.5, 0.2)], [0.0, 0.0])
    assert vest.planning_profile().f_ms == tuple(1.0 + (0.1, 0.5, 0.2)[r] for r in layout.stage_to_rank)


def test_gap_per_action_is_the_typical_time_between_actions_not_waiting_for_an_input():
    from titan_ext.runtime.measure.profiler import ActionRecord, IterationProfile

    # F 0–1 s; I 2–3 s after a 0.5 s input wait (gap 0.5 s); W 3.25–4 s (gap 0.25 s); F 9–10 s (a 5 s
    # stall, gap 5 s): 3 samples, their median 500 ms (stall_free_mean), whatever the stall's length
    acts = [ActionRecord("F", 0, 0, 0.0, 1.0), ActionRecord("I", 0, 0, 2.0, 3.0, recv_wait_ms=500.0),
            ActionRecord("W", 0, 0, 3.25, 4.0), ActionRecord("F", 0, 1, 9.0, 10.0)]
    assert abs(IterationProfile(acts).gap_ms() - 500.0) < 1e-9
    assert abs(IterationProfile(list(reversed(acts))).gap_ms() - 500.0) < 1e-9  # in the order they ran
    assert math.isnan(IterationProfile(acts[:1]).gap_ms())


def test_a_capped_plan_that_holds_all_its_memory_allows_is_held_not_replanned():
    """The estimate carries the runtime's per-stage caps (PipelineProfile.max_inflight): Alg.2's target is
    clipped there, so a violated link the cap keeps from more slackness is a hold (it was an adapt at every
    check: 11 plan versions in 11 iterations at 1F1B's memory and +60 ms)."""
    free = PipelineProfile.uniform(4, 16, 2.0, 2.0, 2.0, delays_ms={2: 60.0})
    capped = PipelineProfile.uniform(4, 16, 2.0, 2.0, 2.0, delays_ms={2: 60.0}, activation_bytes=(1.0,) * 4,
                                     memory_budget_bytes=(4.0,) * 4)
    counts = [4, 4, 4, 1]
    assert ReplanPolicy().decide(free, counts, counts, 5).action == "adapt"
    assert ReplanPolicy().decide(capped, counts, counts, 5).action == "hold"


def test_a_plan_made_for_the_measured_delay_is_neither_re_planned_nor_shrunk_while_it_holds():
    """The planner picks by the simulator and may keep less slackness on a slow link than Eq. 1 asks for.
    Judged by Eq. 1 alone that plan is violated at once (a re-plan of the same delay), and a recovery
    candidate with less slackness "suffices" (a shrink of the same delay): a constant delay churns.  With the
    delays the plan was planned for (``note_deployed``), the same delay keeps it; a delay that grew past them
    re-plans; one that fell below them by the margins shrinks after the patience."""
    initial = initial_warmup_counts(S, 2 * S - 1)
    pol = ReplanPolicy(recover_patience=2, min_dwell=0)
    c = 30.0
    # Eq. 1 on link 2 for Δ = 3: (3·20 − 20)/2 = 20 ms < 30 ms — violated by Eq. 1 alone
    chosen = [x + 1 if i < 3 else x for i, x in enumerate(initial)]
    assert link_tolerance_ms(_profile({}), chosen, 2) < c
    assert ReplanPolicy().decide(_profile({2: c}), chosen, initial, 5).action == "adapt"
    planned = [0.0, 0.0, pol.headroom_delay(c)]
    pol.note_deployed(planned)
    assert [pol.decide(_profile({2: c * f}), chosen, initial, 5).action for f in (1.0, 1.05, 0.95, 1.0)] == \
        ["keep"] * 4
    # a deployed plan with more slackness than Alg.2 now asks for, the same delay: no shrink either
    big = adapted_warmup_counts(_profile({2: pol.headroom_delay(3 * c)}))
    pol.note_deployed(planned)
    assert [pol.decide(_profile({2: c}), big, initial, 5).action for _ in range(4)] == ["keep"] * 4
    # grown past the planned delay: re-plan; fallen below it by the margins: shrink after the patience
    assert pol.decide(_profile({2: 1.2 * c}), chosen, initial, 5).action == "adapt"
    pol.note_deployed(planned)
    assert [pol.decide(_profile({2: 0.5 * c}), big, initial, 5).action for _ in range(2)] == ["keep", "shrink"]
    # a plan not made for measured delays (Alg.1's initial plan, a user's): Eq. 1 alone, as before
    pol.note_deployed(None)
    assert pol.decide(_profile({2: c}), chosen, initial, 5).action == "adapt"


def test_action_times_are_a_mean_with_the_tail_kept_and_isolated_stalls_dropped():
    from titan_ext.runtime.measure.profiler import ActionRecord, IterationProfile, stall_free_mean

    # 20 F of a right-skewed CPU: 16 × 2.0 ms, 3 × 3.0 ms (oversleep), one 50 ms stall (> 4 × 3.0): the
    # stall goes, the oversleep stays: (16 × 2.0 + 3 × 3.0) / 19
    durations = [2.0] * 16 + [3.0] * 3 + [50.0]
    acts, t = [], 0.0
    for k, d in enumerate(durations):
        acts.append(ActionRecord("F", 0, k, t, t + d / 1e3))
        t += d / 1e3 + 0.001
    assert abs(IterationProfile(acts).compute_ms("F") - (16 * 2.0 + 3 * 3.0) / 19) < 1e-9
    # a busy host's gaps: most short, a tail of preemptions rising without a 4x jump: the plain mean
    tail = [0.1] * 40 + [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 6.5]
    assert abs(stall_free_mean(tail) - sum(tail) / len(tail)) < 1e-12
    # two stalls within the top 10 % (the lower one > 4 × the next sample): both go
    assert abs(stall_free_mean([2.0] * 18 + [45.0, 40.0]) - 2.0) < 1e-12
    # a "stall" in more than the top 10 % of the samples is a tail: kept (10 samples: only the largest
    # may be a stall, and it is no jump above its equal)
    assert abs(stall_free_mean([1.0] * 8 + [10.0, 10.0]) - 2.8) < 1e-12
    assert abs(stall_free_mean([5.0, 1.0, 3.0]) - 3.0) < 1e-12  # below 5 samples: the median
    assert math.isnan(stall_free_mean([]))
