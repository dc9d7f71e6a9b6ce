"""Several stages per rank (docs/multistage.md): placements, warm-up rule, generator, portfolio, CLI.

References are independent of the code under test: torch's own stage→rank mapping and built-in
schedules (plan.builtin), simulate's rank-level model, the ZBV closed form of the ZB paper, and the
validator (torch's lowering + dry run)."""

import json
import random

import pytest

from titan_ext.cli import main
from titan_ext.plan import LinkProfile, PipelineProfile, simulate, validate_plan
from titan_ext.plan.builtin import builtin_plan
from titan_ext.plan.ir import torch_schedules
from titan_ext.plan.virtual import (
    generate_virtual_order,
    plan_virtual,
    virtual_link_tolerance_ms,
    virtual_profile,
    virtual_stage_to_rank,
    virtual_warmup_counts,
)

BUILTINS4 = ("ZBVZeroBubble", "DualPipeV", "Interleaved1F1B", "InterleavedZeroBubble")


def _torch_ms(name, profile):
    """torch's built-in schedule simulated with the rank-level profile (simulate's own chunk model)."""
    plan, s2r = builtin_plan(name, profile.num_stages, profile.num_microbatches)
    return simulate(plan, profile, stage_to_rank=s2r).makespan_ms


@pytest.mark.parametrize("R, V", [(2, 2), (4, 2), (3, 3), (4, 4)])
@pytest.mark.parametrize("placement", ["loop", "v"])
def test_placement_is_torchs(R, V, placement):
    mapping = torch_schedules().generate_stage_to_rank_mapping(R, R * V, style=placement)
    assert virtual_stage_to_rank(R, V, placement) == tuple(mapping[s] for s in range(R * V))


@pytest.mark.parametrize("name", BUILTINS4)
def test_stage_profile_matches_simulates_rank_model(name):
    """virtual_profile's stage-level profile and simulate's rank-level model time torch's plans alike
    (heterogeneous ranks, latency and bandwidth on two rank links)."""
    links = (LinkProfile(), LinkProfile(latency_ms=7, bandwidth_bytes_per_s=1e6, message_bytes=4e3), LinkProfile(latency_ms=13))
    rank_profile = PipelineProfile(4, 8, (8, 10, 12, 9), (9, 11, 10, 12), (5, 3, 7, 6), links)
    placement = "v" if name in ("ZBVZeroBubble", "DualPipeV") else "loop"
    stage_profile, s2r = virtual_profile(rank_profile, 2, placement)
    plan, _ = builtin_plan(name, 4, 8)
    assert simulate(plan, stage_profile).makespan_ms == pytest.approx(_torch_ms(name, rank_profile))


@pytest.mark.parametrize("placement", ["loop", "v"])
@pytest.mark.parametrize("R, V, N", [(2, 2, 8), (4, 2, 16), (4, 2, 24), (3, 2, 12), (4, 3, 24), (3, 4, 12)])
def test_no_delay_plan_is_zero_bubble(placement, R, V, N):
    """No delay: x_s = S − s (torch's per-stage peak for V = 2) and the plan meets ZBV's closed form
    generalised to V chunks, T = 3N·t + (R−1)·t/V (ZB paper §6; tests/plan/test_plan_builtin_validate.py
    checks it for torch's ZBV), in both placements."""
    t = 10.0
    stage_profile, s2r = virtual_profile(PipelineProfile.uniform(R, N, t, t, t), V, placement)
    x = virtual_warmup_counts(stage_profile, s2r)
    assert x == [R * V - s for s in range(R * V)]
    gen = generate_virtual_order(stage_profile, s2r, x)
    validate_plan(gen.order, R * V, N, inflight_limit=x)
    assert simulate(gen.order, stage_profile).makespan_ms == pytest.approx(3 * N * t + (R - 1) * t / V, abs=1e-3)


def test_warmup_rule_and_tolerance_closed_form():
    """Uniform t per rank in V = 2 chunks: Δ_s = ⌈(t + 2c)/(2t)⌉ on boundaries crossing the slow link,
    1 elsewhere, and the tolerance of Δ is (Δ − 1/V)·t."""
    t, c = 10.0, 60.0
    stage_profile, s2r = virtual_profile(PipelineProfile.uniform(4, 64, t, t, t, delays_ms={2: c}), 2, "loop")
    x = virtual_warmup_counts(stage_profile, s2r)
    delta = [x[s] - x[s + 1] for s in range(7)]
    need = -(-(t + 2 * c) // (2 * t))  # ceil
    assert delta == [1, 1, need, 1, 1, 1, need]  # boundaries 2→3 and 6→7 cross rank link 2
    assert virtual_link_tolerance_ms(stage_profile, s2r, x, 2) == pytest.approx((need - 0.5) * t)
    assert virtual_link_tolerance_ms(stage_profile, s2r, x, 0) == pytest.approx(0.5 * t)  # Δ = 1


@pytest.mark.parametrize("placement", ["loop", "v"])
def test_adapted_counts_absorb_what_unadapted_counts_cascade(placement):
    """Theorem-1 analogue, measured: with +60 ms on rank link 2, the capped plan with the rule's counts
    loses at most 2.5·c at both N = 24 and N = 48 (absorbed: Θ(c)), while the no-delay counts (Δ = 1) lose
    time growing with N (cascade)."""
    loss = {}
    for N in (24, 48):
        base = PipelineProfile.uniform(4, N, 10, 10, 10)
        fast, s2r = virtual_profile(base, 2, placement)
        slow, _ = virtual_profile(base.with_delays({2: 60}), 2, placement)
        ref = simulate(generate_virtual_order(fast, s2r, virtual_warmup_counts(fast, s2r)).order, fast).makespan_ms
        for name, x in (("adapted", virtual_warmup_counts(slow, s2r)), ("unadapted", virtual_warmup_counts(fast, s2r))):
            loss[name, N] = simulate(generate_virtual_order(slow, s2r, x).order, slow).makespan_ms - ref
    assert loss["adapted", 24] <= 2.5 * 60 and loss["adapted", 48] <= 2.5 * 60
    assert loss["unadapted", 48] > loss["unadapted", 24] + 5 * 60  # +24 microbatches, >= 12.5 ms each


@pytest.mark.parametrize("delay", [0, 30, 60, 120])
@pytest.mark.parametrize("placement", ["loop", "v"])
def test_must_show_uniform(placement, delay):
    """R=4, V=2, N=16, t=10,10,10, +delay on rank link 2, torch's schedules from torch."""
    profile = PipelineProfile.uniform(4, 16, 10, 10, 10, delays_ms={2: delay} if delay else {})
    plan = plan_virtual(profile, 2, placement)
    ours = simulate(plan.actions, plan.profile).makespan_ms
    assert ours == pytest.approx(plan.predicted_makespan_ms)
    torch_ms = {name: _torch_ms(name, profile) for name in BUILTINS4}
    if delay == 0:
        base = torch_ms["ZBVZeroBubble" if placement == "v" else "InterleavedZeroBubble"]
        assert ours <= 1.005 * base
    else:
        assert ours <= min(torch_ms.values())
        # our own generator (not a torch member of the portfolio) is what wins under delay
        assert plan.source.startswith("pipemorph") and plan.warmup_counts is not None
    if delay == 60:
        assert ours <= 0.5 * torch_ms["ZBVZeroBubble"]


@pytest.mark.parametrize("seed", range(6))
def test_random_heterogeneous(seed):
    """Random per-rank times and delays: ours ≤ min of the four torch schedules under delay, and ≤ the
    placement's zero-bubble built-in + 0.5 % without; per-stage heterogeneous chunks validate and the
    generator's timeline is the simulator's."""
    rng = random.Random(seed)
    R = rng.choice((3, 4))
    N = rng.choice((2 * R, 3 * R, 4 * R))
    f, b, w = ([rng.uniform(5, 15) for _ in range(R)] for _ in range(3))
    delays = {rng.randrange(R - 1): rng.choice((15.0, 40.0, 90.0))}
    plain = PipelineProfile(R, N, f, b, w)
    slow = plain.with_delays(delays)
    for placement in ("loop", "v"):
        zb = "ZBVZeroBubble" if placement == "v" else "InterleavedZeroBubble"
        p0 = plan_virtual(plain, 2, placement)
        assert simulate(p0.actions, p0.profile).makespan_ms <= 1.005 * _torch_ms(zb, plain) + 1e-9
        p1 = plan_virtual(slow, 2, placement)
        assert simulate(p1.actions, p1.profile).makespan_ms <= min(_torch_ms(n, slow) for n in BUILTINS4) + 1e-9
    chunks = tuple([rng.uniform(2, 8) for _ in range(2 * R)] for _ in range(3))
    plan = plan_virtual(slow, 2, "v", stage_times_ms=chunks)
    stage_profile, s2r = virtual_profile(slow, 2, "v", stage_times_ms=chunks)
    x = virtual_warmup_counts(stage_profile, s2r)
    gen = generate_virtual_order(stage_profile, s2r, x)
    validate_plan(gen.order, 2 * R, N, inflight_limit=x)
    assert simulate(gen.order, stage_profile).makespan_ms == pytest.approx(gen.makespan_ms)
    assert plan.predicted_makespan_ms <= gen.makespan_ms + 1e-9


def test_memory_limit_caps_every_candidate():
    profile = PipelineProfile.uniform(4, 16, 10, 10, 10, delays_ms={2: 60})
    plan = plan_virtual(profile, 2, "v", stage_memory_limit=6)
    assert max(simulate(plan.actions, plan.profile).peak_inflight.values()) <= 6
    assert "torch:ZBVZeroBubble" not in plan.candidates  # ZBV holds 8 on stage 0
    with pytest.raises(ValueError, match="crosspipe-wave"):
        plan_virtual(profile, 2, "loop", schedule="crosspipe-wave")


def _cli_json(capsys, *args):
    assert main(list(args)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_matches_simulate_builtin(capsys):
    """`plan --virtual-stages` times torch's ZBV exactly as `simulate --builtin ZBVZeroBubble --stages R`."""
    common = ["--stages", "4", "--microbatches", "16", "--times", "10,10,10", "--delay", "2:60", "--json"]
    ours = _cli_json(capsys, "plan", "--virtual-stages", "2", "--placement", "v", *common)
    zbv = _cli_json(capsys, "simulate", "--builtin", "ZBVZeroBubble", *common)
    assert ours["candidates"]["torch:ZBVZeroBubble"] == zbv["makespan_ms"]
    assert ours["makespan_ms"] <= 0.5 * zbv["makespan_ms"]
    # the memory it pays for that, per rank: at least the stage peaks of the rank's busiest stage
    assert len(ours["peak_inflight_per_rank"]) == 4
    assert max(ours["peak_inflight_per_rank"]) >= max(ours["peak_inflight"].values())
    wave = _cli_json(capsys, "plan", "--virtual-stages", "2", "--placement", "v", "--schedule", "crosspipe-wave", *common)
    assert wave["source"] == "crosswave" and wave["makespan_ms"] < zbv["makespan_ms"]


@pytest.mark.parametrize("args, needle", [
    (["--virtual-stages", "2", "--schedule", "zb"], "choose one of"),
    (["--virtual-stages", "1"], "in [2, "),
    (["--placement", "v"], "needs --virtual-stages"),
    (["--virtual-stages", "2", "--placement", "loop", "--schedule", "crosspipe-wave"], "V-shape"),
])
def test_cli_bad_input_one_line_exit_2(capsys, args, needle):
    code = main(["plan", "--stages", "4", "--microbatches", "16", "--times", "10,10,10", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and needle in err and len(err.splitlines()) == 1


def _loss_growth(R, placement, chunks, link, c, x):
    """(cost of the delay at N = 4S, its growth from N = 4S to 8S, the no-delay steady-state period T0,
    the stage profile with the delay, s2r) of the capped order (L = x)."""
    S, ms = 2 * R, {}
    for N in (4 * S, 8 * S):
        plain = PipelineProfile(R, N, [1] * R, [1] * R, [1] * R)
        slow, s2r = virtual_profile(plain.with_delays({link: c}), 2, placement, stage_times_ms=chunks)
        fast, _ = virtual_profile(plain, 2, placement, stage_times_ms=chunks)
        xn = [min(v, N) for v in x]
        ms[N, c] = generate_virtual_order(slow, s2r, xn, xn).makespan_ms
        ms[N, 0] = generate_virtual_order(fast, s2r, xn, xn).makespan_ms
    loss = [ms[N, c] - ms[N, 0] for N in (4 * S, 8 * S)]
    return loss[0], loss[1] - loss[0], (ms[8 * S, 0] - ms[4 * S, 0]) / (4 * S), slow, s2r


def _random_case(seed):
    rng = random.Random(seed)
    R, placement = rng.choice((3, 4)), rng.choice(("loop", "v"))
    chunks = tuple([rng.uniform(2, 8) for _ in range(2 * R)] for _ in range(3))
    return rng, R, placement, chunks, rng.randrange(R - 1), rng.choice((20.0, 40.0, 80.0))


@pytest.mark.parametrize("seed", range(8))
def test_rule_is_sufficient_on_random_heterogeneous(seed):
    """random chunk times (ranks with different periods), either placement, one slow rank
    link: the rule's counts (capped at x_s) absorb the delay — its cost does not grow with N (no
    cascade) and stays ≤ 2.5c."""
    _, R, placement, chunks, link, c = _random_case(100 + seed)
    stage_profile, s2r = virtual_profile(PipelineProfile(R, 16 * R, [1] * R, [1] * R, [1] * R).with_delays({link: c}),
                                         2, placement, stage_times_ms=chunks)
    x = virtual_warmup_counts(stage_profile, s2r)
    loss, growth, _, _, _ = _loss_growth(R, placement, chunks, link, c, x)
    assert growth <= 1e-6 and loss <= 2.5 * c


@pytest.mark.parametrize("seed", range(24))
def test_necessary_condition_on_random_heterogeneous(seed):
    """Random warm-up counts: wherever x_s·T0 < t^B_s + t^F_{S−1} + Σ_{u≥s} K_u for some stage (T0 the
    plan's measured no-delay period), the delay cascades (its cost grows with N by > 1 ms)."""
    from titan_ext.plan.virtual import necessary_warmup_counts

    rng, R, placement, chunks, link, c = _random_case(200 + seed)
    x = [1] * (2 * R)
    for s in range(2 * R - 2, -1, -1):
        x[s] = x[s + 1] + rng.choice((1, 1, 2, 3))
    _, growth, period, slow, s2r = _loss_growth(R, placement, chunks, link, c, x)
    need = necessary_warmup_counts(slow, s2r, period)
    if any(v < n for v, n in zip(x, need)):
        assert growth > 1.0, (x, need)
