"""Alg.1 / Alg.2 / Eq.1 against hand-worked cases."""

import pytest

from titan_ext.plan import (
    PipelineProfile,
    absorbs_delay,
    adapted_warmup_counts,
    initial_warmup_counts,
    initial_warmup_counts_for,
    link_tolerance_ms,
    link_tolerances_ms,
    required_slackness,
    slackness,
)


@pytest.mark.parametrize(
    "S, xmax, expected",
    [
        (4, 7, [7, 5, 3, 1]),  # Δ_avg = 2, r = 0
        (4, 8, [8, 5, 3, 1]),  # Δ_avg = 2, r = 1: the first link gets one more
        (4, 9, [9, 6, 3, 1]),  # r = 2
        (3, 2, [2, 1, 1]),  # Δ_avg = 0, r = 1
        (1, 5, [5]),
        (5, 5, [5, 4, 3, 2, 1]),
    ],
)
def test_alg1_hand_cases(S, xmax, expected):
    assert initial_warmup_counts(S, xmax) == expected


def test_alg1_is_max_min_slackness():
    """Brute force over all non-increasing x with x_0 = x_max and x_{S-1} >= 1: Alg.1 maximises min Δ."""
    import itertools

    for S in (3, 4, 5):
        for xmax in range(S, 12):
            best = -1
            for rest in itertools.product(range(1, xmax + 1), repeat=S - 1):
                xs = [xmax, *rest]
                if all(a >= b for a, b in zip(xs, xs[1:])):
                    best = max(best, min(slackness(xs)))
            assert min(slackness(initial_warmup_counts(S, xmax))) == best


def test_alg1_from_memory_budget():
    p = PipelineProfile.uniform(4, 16, 10, 10, 10, activation_bytes=1e6, memory_budget_bytes=7.9e6)
    assert initial_warmup_counts_for(p) == [7, 5, 3, 1]
    assert initial_warmup_counts_for(p, memory_limit=4) == [4, 3, 2, 1]


def test_alg2_hand_cases():
    # uniform t=10: Δ = max(ceil((20 + 2c)/20), floor) = max(ceil(1 + c/10), 2)
    p = PipelineProfile.uniform(4, 16, 10, 10, 10, delays_ms={2: 30})
    assert adapted_warmup_counts(p) == [1 + 4 + 2 + 2, 1 + 4 + 2, 1 + 4, 1]  # Δ_2 = ceil(80/20) = 4
    assert adapted_warmup_counts(p, slack_floor=1) == [7, 6, 5, 1]
    # clipped at N - 2S = 8 - ... : N=12, S=4 → clip 4
    p = PipelineProfile.uniform(4, 12, 10, 10, 10, delays_ms={0: 100})
    assert adapted_warmup_counts(p) == [5 + 4, 5, 3, 1]
    # non-uniform: Δ_0 = ceil((5 + 7 + 2*4) / (2 + 3)) = ceil(20 / 5) = 4
    p = PipelineProfile(2, 8, [5, 2], [7, 3], [1, 1], PipelineProfile.uniform(2, 8, 1, 1, 1, {0: 4}).links)
    assert adapted_warmup_counts(p) == [5, 1]


def test_eq1_tolerance():
    p = PipelineProfile.uniform(4, 12, 10, 10, 10)
    x = [7, 5, 3, 1]
    # Theorem 1: tolerance (Δ − 1) t = 10 ms on every link
    assert [link_tolerance_ms(p, x, i) for i in range(3)] == [10.0, 10.0, 10.0]
    assert absorbs_delay(p, x, 0, 10.0)
    assert not absorbs_delay(p, x, 0, 10.5)
    p2 = p.with_delays({1: 25})
    assert not absorbs_delay(p2, x, 1)
    assert absorbs_delay(p2, adapted_warmup_counts(p2), 1)


@pytest.mark.parametrize("S, N", [(4, 4), (4, 6), (6, 8)])
def test_eq1_tolerance_is_infinite_without_a_steady_phase(S, N):
    """A stage that runs all N forwards before its first backward (GPipe's shape) has no steady phase,
    so Theorem 1's cascade cannot happen on its link: the delay costs its fill and drain once (2c), at any
    c.  Checked with the simulator (an independent replay of the order), beside a plan with slackness 2
    whose finite tolerance the same delay breaks (it costs far more than 2c)."""
    from titan_ext.plan import generate_order
    from titan_ext.plan.result import warmup_counts_of
    from titan_ext.plan.simulate import replay_makespan_ns

    p = PipelineProfile.uniform(S, N, 2, 2, 2)
    gpipe = generate_order(p, [N] * (S - 1) + [1], inflight_limit=[N] * S).order
    x = warmup_counts_of(gpipe)
    assert x[:-1] == [N] * (S - 1)
    base, c = replay_makespan_ns(gpipe, p), 200.0
    for link in range(S - 1):
        assert link_tolerance_ms(p, x, link) == float("inf")
        grown = replay_makespan_ns(gpipe, p.with_delays({link: c})) - base
        assert grown == pytest.approx(2 * c * 1e6, abs=1e3)
    lean = generate_order(p, [min(N, 2 * (S - i) - 1) for i in range(S)]).order  # Δ = 2 on the last link
    xl, last = warmup_counts_of(lean), S - 2
    assert xl[last] < N and link_tolerance_ms(p, xl, last) < c
    assert replay_makespan_ns(lean, p.with_delays({last: c})) - replay_makespan_ns(lean, p) > 3 * c * 1e6


def test_plan_slackness_reports_only_decreasing_counts():
    from titan_ext.plan.warmup import plan_slackness

    assert plan_slackness([12, 11, 9, 1]) == slackness([12, 11, 9, 1]) == [1, 2, 8]
    assert plan_slackness([8, 7, 8, 4]) is None  # a multi-stage plan's targets: no slackness, no error
    with pytest.raises(ValueError, match="non-increasing"):
        slackness([8, 7, 8, 4])


def test_every_links_tolerance_is_the_largest_delay_its_slackness_covers():
    """link_tolerances_ms (all links at once, what the runtime's policy reads per check) against Eq.1
    from the other side, ``required_slackness`` (the Δ a delay needs): on random profiles and counts, each
    link's finite tolerance t is covered by its Δ and t + 1 µs is not; a link whose stage runs all N
    forwards has none (inf)."""
    import random

    rng = random.Random(7)
    for _ in range(300):
        S, N = rng.randint(2, 9), rng.randint(2, 40)
        p = PipelineProfile(S, N, [rng.uniform(0.5, 9) for _ in range(S)], [rng.uniform(0.5, 9) for _ in range(S)],
                            [rng.uniform(0, 5) for _ in range(S)])
        x = sorted((rng.randint(1, N + 2) for _ in range(S)), reverse=True)
        tol = link_tolerances_ms(p, x)
        assert len(tol) == S - 1
        for i, t in enumerate(tol):
            assert t == link_tolerance_ms(p, x, i)
            if x[i] >= N:
                assert t == float("inf")
                continue
            delta = x[i] - x[i + 1]
            if t >= 0:
                assert required_slackness(p, i, t) <= max(delta, 1)
            assert required_slackness(p, i, max(t, 0.0) + 1e-3) > delta
