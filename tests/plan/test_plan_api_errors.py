"""Python API: a wrong type or an impossible value raises ValueError naming the argument (not a
TypeError / AttributeError / IndexError from inside a planner), and simulate refuses a plan that is
incomplete or does not match its profile instead of timing it."""

from __future__ import annotations

import pytest

from titan_ext.plan import (
    LinkProfile,
    PipelineProfile,
    adapted_warmup_counts,
    as_ops,
    generate_order,
    initial_warmup_counts,
    link_tolerance_ms,
    plan_crosspipe,
    plan_pipemorph,
    required_slackness,
    simulate,
    slackness,
    to_torch_plan,
    validate_plan,
)
from titan_ext.plan.schedules import plan_by_name
from titan_ext.plan.virtual import plan_virtual

P = PipelineProfile.uniform(4, 12, 10, 10, 10)

# name: (call, the ValueError must contain)
BAD = {
    "uniform_stages_text": (lambda: PipelineProfile.uniform("4", 12, 10, 10, 10), "num_stages"),
    "uniform_microbatches_float": (lambda: PipelineProfile.uniform(4, 12.0, 10, 10, 10), "num_microbatches"),
    "uniform_time_text": (lambda: PipelineProfile.uniform(4, 12, "10", 10, 10), "f_ms"),
    "uniform_delays_list": (lambda: PipelineProfile.uniform(4, 12, 10, 10, 10, delays_ms=[5]), "delays_ms"),
    "uniform_delays_text_link": (lambda: PipelineProfile.uniform(4, 12, 10, 10, 10, delays_ms={"0": 5}), "delays_ms"),
    "profile_links_int": (lambda: PipelineProfile(4, 12, 1, 1, 1, links=5), "links"),
    "profile_time_inf": (lambda: PipelineProfile(4, 12, float("inf"), 1, 1), "f_ms[0]"),
    "profile_time_subnanosecond": (lambda: PipelineProfile(4, 12, 1e-300, 1, 1), "f_ms[0]"),
    "profile_time_absurd": (lambda: PipelineProfile(4, 12, 1e300, 1, 1), "f_ms[0]"),
    "link_text": (lambda: LinkProfile("1"), "latency_ms"),
    "link_transfer_overflow": (lambda: LinkProfile(0, 1e-291, 1e15), "message_bytes / bandwidth_bytes_per_s"),
    "plan_pipemorph_none": (lambda: plan_pipemorph(None), "profile must be a PipelineProfile"),
    "plan_pipemorph_slack_text": (lambda: plan_pipemorph(P, slack_floor="2"), "slack_floor"),
    "plan_by_name_none": (lambda: plan_by_name(None, "pipemorph"), "profile must be a PipelineProfile"),
    "plan_crosspipe_none": (lambda: plan_crosspipe(None), "profile must be a PipelineProfile"),
    "plan_by_name_optimal_time": (lambda: plan_by_name(P, "optimal", time_limit_s=-1), "time_limit_s"),
    "plan_virtual_float_v": (lambda: plan_virtual(P, 2.5), "num_virtual_stages"),
    "plan_virtual_none": (lambda: plan_virtual(None), "profile must be a PipelineProfile"),
    "simulate_profile_none": (lambda: simulate({0: []}, None), "profile must be a PipelineProfile"),
    "simulate_plan_none": (lambda: simulate(None, P), "plan must be a mapping"),
    "simulate_hol_text": (lambda: simulate(plan_pipemorph(P).actions, P, hol="yes"), "hol"),
    "validate_plan_none": (lambda: validate_plan(None, 4, 12), "plan must be a mapping"),
    "validate_stages_text": (lambda: validate_plan(plan_pipemorph(P).actions, "4", 12), "num_stages"),
    "slackness_none": (lambda: slackness(None), "warmup_counts"),
    "initial_warmup_text": (lambda: initial_warmup_counts("4", 8), "num_stages"),
    "required_slackness_no_link": (lambda: required_slackness(P, 9), "link 9 does not exist"),
    "tolerance_short_counts": (lambda: link_tolerance_ms(P, [1], 0), "warmup_counts has 1 entries"),
    "adapted_floor_none": (lambda: adapted_warmup_counts(P, None), "slack_floor"),
    "as_ops_none": (lambda: as_ops(None), "plan must be a mapping"),
    "to_torch_plan_none": (lambda: to_torch_plan(None), "plan must be a mapping"),
    "generate_order_none": (lambda: generate_order(P, None), "warmup_counts"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_call_raises_value_error_naming_the_argument(case):
    call, needle = BAD[case]
    with pytest.raises(ValueError) as exc:
        call()
    assert needle in str(exc.value), str(exc.value)


def test_simulate_refuses_incomplete_or_mismatched_plans():
    """a plan with half of each rank's actions timed 210 ms, and a 12-microbatch plan was timed
    under 8- and 24-microbatch profiles. The complete plan under its own profile is PipeMorph Fig.4's
    ZeroBubble (390 ms), so the refusals are not a broken simulator."""
    plan = plan_pipemorph(P, candidates=False).actions
    assert simulate(plan, P).makespan_ms == 390.0
    half = {r: acts[: len(acts) // 2] for r, acts in plan.items()}
    with pytest.raises(ValueError, match="has no"):
        simulate(half, P)
    for n in (8, 24):
        with pytest.raises(ValueError, match=f"the plan has 12 microbatches, the profile {n}"):
            simulate(plan, PipelineProfile.uniform(4, n, 10, 10, 10))
    with pytest.raises(ValueError, match="profile has 3 stages"):
        simulate(plan, PipelineProfile.uniform(3, 12, 10, 10, 10))
    dropped = {r: [a for a in acts if not (r == 2 and str(a) == "2W5")] for r, acts in plan.items()}
    with pytest.raises(ValueError, match="stage 2 microbatch 5 has no W"):
        simulate(dropped, P)


def test_huge_memory_budget_ratio_caps_at_the_microbatches():
    """max_inflight() of a 1e600 budget/activation ratio: N (more never matters), not an OverflowError."""
    p = PipelineProfile.uniform(4, 12, 10, 10, 10, activation_bytes=1e-300, memory_budget_bytes=1e300)
    assert p.max_inflight() == (12, 12, 12, 12)
    assert simulate(plan_pipemorph(p).actions, p).makespan_ms == 390.0
