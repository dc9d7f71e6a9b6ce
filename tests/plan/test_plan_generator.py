"""The event-driven generator against PipeMorph Alg.3/4 written literally (``testing.references``), and a
validity fuzz."""

import random

import pytest

from titan_ext.plan import (
    LinkProfile,
    PipelineProfile,
    generate_order,
    plan_pipemorph,
    simulate,
    validate_plan,
)
from titan_ext.testing.references import alg4_literal


@pytest.mark.parametrize("seed", range(40))
def test_generator_equals_brute_force(seed):
    rng = random.Random(seed)
    S = rng.randint(1, 5)
    N = rng.randint(S, 10)
    tf = [rng.randint(5, 30) for _ in range(S)]  # units of 0.1 ms
    tb = [rng.randint(5, 30) for _ in range(S)]
    tw = [rng.randint(1, 20) for _ in range(S)]
    c = [rng.choice([0, 0, rng.randint(1, 80)]) for _ in range(S - 1)]
    x = sorted((rng.randint(1, N) for _ in range(S)), reverse=True)
    limit = [xi + rng.choice([0, 0, 1, 3, N]) for xi in x]
    prof = PipelineProfile(
        S, N, [v / 10 for v in tf], [v / 10 for v in tb], [v / 10 for v in tw],
    ).with_delays({i: ci / 10 for i, ci in enumerate(c)})
    ours = generate_order(prof, x, limit)
    ref_order, ref_end = alg4_literal(tf, tb, tw, c, N, x, limit)  # δ = 1 unit (0.1 ms): exact
    assert [ours.order[i] for i in range(S)] == ref_order
    assert ours.makespan_ms == pytest.approx(ref_end / 10)
    # the generator's own timeline is what the simulator computes for its plan
    assert simulate(ours.order, prof).makespan_ms == pytest.approx(ours.makespan_ms)


def random_profile(rng, S, N):
    from titan_ext.plan import LinkProfile

    links = []
    for _ in range(S - 1):
        kind = rng.random()
        if kind < 0.5:
            links.append(LinkProfile())
        elif kind < 0.8:
            links.append(LinkProfile(latency_ms=rng.uniform(0, 80)))
        else:
            links.append(LinkProfile(rng.uniform(0, 20), rng.uniform(1e8, 1e10), rng.uniform(1e6, 1e8)))
    return PipelineProfile(
        S, N,
        [rng.uniform(1, 20) for _ in range(S)],
        [rng.uniform(1, 30) for _ in range(S)],
        [rng.uniform(0, 15) for _ in range(S)],
        tuple(links),
    )


FUZZ_CASES, FUZZ_BLOCK = 1000, 200  # the default tier runs the first block, the `slow` tier the rest


@pytest.mark.parametrize("block", [b if b == 0 else pytest.param(b, marks=pytest.mark.slow)
                                   for b in range(FUZZ_CASES // FUZZ_BLOCK)])
def test_validity_fuzz_1000_cases(block):
    """1000 random cases (S ≤ 16, N ≤ 64, heterogeneous times, delays, memory limits) in 5 blocks of
    one random stream: every plan passes the validator, torch's lowering and dry run included
    (plan_pipemorph validates before returning; validate again here explicitly)."""
    rng = random.Random(2026)
    for case in range(FUZZ_CASES):
        S = rng.randint(1, 16)
        N = rng.randint(S, min(64, max(S, 4 * S)))
        prof = random_profile(rng, S, N)
        schedule = rng.choice(["pipemorph", "pipemorph", "zb", "zb-h1"])
        memory_limit = rng.choice([None, None, rng.randint(1, N)])
        slack_floor, cap = rng.choice([1, 2]), rng.random() < 0.8
        if case // FUZZ_BLOCK != block:  # the same cases as one 1000-case run, split in blocks
            continue
        plan = plan_pipemorph(
            prof, schedule=schedule, slack_floor=slack_floor, memory_limit=memory_limit,
            cap_inflight=cap,
        )
        validate_plan(plan.actions, S, N, inflight_limit=plan.inflight_limit)
        if memory_limit is not None:
            assert max(simulate(plan.actions, prof).peak_inflight.values()) <= max(memory_limit, 1)


@pytest.mark.parametrize("S,N", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_full_backward_with_1f1b_warmup_is_torchs_1f1b(S, N):
    """``full_backward`` with x_i = S − i (and in-flight activations capped at x_i, as plan_pipemorph
    does) and uniform times reproduces torch's own Schedule1F1B order (the independent reference) and
    1F1B's closed-form makespan (N + S − 1)(t_F + t_B + t_W)."""
    from titan_ext.plan.builtin import builtin_plan
    from titan_ext.plan.ir import as_ops

    prof = PipelineProfile.uniform(S, N, 10.0, 6.0, 4.0)
    x = [S - i for i in range(S)]
    gen = generate_order(prof, x, inflight_limit=x, full_backward=True)
    assert gen.order == as_ops(builtin_plan("1F1B", S, N)[0])
    assert gen.makespan_ms == pytest.approx((N + S - 1) * 20.0)
    validate_plan(gen.order, S, N)


@pytest.mark.parametrize("seed", range(30))
def test_full_backward_plans_validate_and_match_the_simulator(seed):
    """Random profiles (delays included), both planner modes: the full-backward plan has only F and B,
    validates (torch's dry run included) within its in-flight caps, and the generator's own timeline
    equals the planning core's simulator on the fused profile."""
    rng = random.Random(seed)
    S = rng.choice([2, 3, 4, 6])
    N = rng.choice([S, 2 * S, 3 * S + 1])
    t = lambda: [round(rng.uniform(2, 12), 1) for _ in range(S)]  # noqa: E731
    delays = {rng.randrange(S - 1): rng.choice([0.0, 15.0, 40.0])} if S > 1 else {}
    links = [LinkProfile() for _ in range(S - 1)]
    for i, d in delays.items():
        links[i] = LinkProfile(latency_ms=d)
    prof = PipelineProfile(S, N, t(), t(), t(), tuple(links))
    plan = plan_pipemorph(prof, backward="full", mode=rng.choice(["initial", "adaptive"]))
    kinds = {k for ops in plan.ops.values() for _, k, _ in ops}
    assert kinds == {"F", "B"}
    validate_plan(plan.actions, S, N, inflight_limit=plan.inflight_limit)
    assert simulate(plan.actions, prof).makespan_ms == pytest.approx(plan.predicted_makespan_ms, abs=1e-6)
    with pytest.raises(ValueError, match="backward must be one of"):
        plan_pipemorph(prof, backward="fused")
