"""PipeMorph's default never loses to the paper's own plans, and our validator agrees with torch's.

Baselines are computed independently of plan_pipemorph's candidate code: the uncapped Alg.2 plan and the
static zb / zb-h1 orders straight from ``generate_order``, 1F1B from torch's own ``Schedule1F1B``
(``builtin_plan``), every makespan from the reference ``simulate``.
"""

from __future__ import annotations

import contextlib
import io
import random

import pytest

from titan_ext.plan import (
    LinkProfile,
    PipelineProfile,
    PlanValidationError,
    adapted_warmup_counts,
    generate_order,
    plan_pipemorph,
    simulate,
    validate_plan,
    zb_h1_warmup_counts,
    zb_warmup_counts,
)
from titan_ext.plan.builtin import builtin_plan
from titan_ext.plan.ir import as_ops, to_torch_plan, torch_schedules
from titan_ext.plan.simulate import replay_makespan_ns
from titan_ext.plan.timing import to_ns

from _plan_cases import mutate as _mutate


def hetero_case(rng: random.Random) -> PipelineProfile:
    """S 3–8, N ∈ {2S, 3S, 4S}, heterogeneous times, 1–2 slow links of 5–80 ms."""
    S = rng.randint(3, 8)
    N = rng.choice([2 * S, 3 * S, 4 * S])
    t = lambda lo, hi: [round(rng.uniform(lo, hi), 2) for _ in range(S)]  # noqa: E731
    delays = {link: round(rng.uniform(5, 80), 2) for link in rng.sample(range(S - 1), rng.randint(1, 2))}
    return PipelineProfile(S, N, t(6, 14), t(6, 16), t(3, 10)).with_delays(delays)


def baselines(prof: PipelineProfile) -> dict[str, float]:
    S, N = prof.num_stages, prof.num_microbatches
    x2 = adapted_warmup_counts(prof)
    static = prof.with_links(())
    plans = {
        "alg2-uncapped": generate_order(prof, x2, None).order,
        "zb": generate_order(static, zb_warmup_counts(S, N), zb_warmup_counts(S, N)).order,
        "zb-h1": generate_order(static, zb_h1_warmup_counts(S), zb_h1_warmup_counts(S)).order,
        "1F1B": builtin_plan("1F1B", S, N)[0],
    }
    return {name: simulate(plan, prof).makespan_ms for name, plan in plans.items()}


def test_never_slower_than_the_papers_plans_500_cases():
    """≥ 500 random heterogeneous cases: PipeMorph ≤ uncapped Alg.2 + 0.1 % and ≤ min(zb, zb-h1, 1F1B)
    + 0.1 %; the predicted makespan is the simulator's; the warm-up counts are those the order runs."""
    rng = random.Random(12)
    wins = 0
    for _ in range(500):
        prof = hetero_case(rng)
        plan = plan_pipemorph(prof)
        got = simulate(plan.actions, prof).makespan_ms
        assert got == pytest.approx(plan.predicted_makespan_ms, abs=1e-6)
        # the reported warm-up counts are what the order runs: forwards before each stage's first backward
        ops = as_ops(plan.actions)
        runs = [next(j for j, (_, kind, _) in enumerate(ops[s]) if kind != "F") for s in range(prof.num_stages)]
        assert plan.warmup_counts == runs, (plan.summary(), runs)
        ref = baselines(prof)
        assert got <= ref["alg2-uncapped"] * 1.001, (prof, plan.summary(), ref)
        assert got <= min(ref["zb"], ref["zb-h1"], ref["1F1B"]) * 1.001, (prof, plan.summary(), ref)
        wins += got < 0.999 * min(ref.values())
    assert wins > 0  # the candidate set is not just a relabelled baseline


def test_memory_limit_holds_500_cases():
    """With a memory limit K (or a byte budget), every plan holds ≤ K in-flight activations per stage
    (counted by the reference simulator) and is no slower than the capped Alg.2 plan at that limit."""
    rng = random.Random(1212)
    for case in range(500):
        prof = hetero_case(rng)
        S, N = prof.num_stages, prof.num_microbatches
        K = rng.randint(1, 2 * S)
        if case % 4 == 0:  # the same limit as bytes in the profile
            prof = PipelineProfile(S, N, prof.f_ms, prof.b_ms, prof.w_ms, prof.links,
                                   activation_bytes=[1e6] * S, memory_budget_bytes=[K * 1e6 + 5e5] * S)
            plan = plan_pipemorph(prof)
        else:
            plan = plan_pipemorph(prof, memory_limit=K)
        tl = simulate(plan.actions, prof)
        assert max(tl.peak_inflight.values()) <= K
        assert tl.peak_inflight == plan.peak_inflight
        x = adapted_warmup_counts(prof, memory_limit=K)
        capped = simulate(generate_order(prof, x, x).order, prof).makespan_ms
        assert tl.makespan_ms <= capped * 1.001


def test_replay_is_the_simulator_bit_for_bit():
    """The planner's flat replay gives exactly simulate's makespan (ns), bandwidth FIFO included, and
    gives up only when the makespan exceeds the bound."""
    rng = random.Random(7)
    for _ in range(150):
        S = rng.randint(1, 6)
        N = rng.randint(S, 3 * S)
        links = [LinkProfile(rng.uniform(0, 30), rng.uniform(1e8, 1e10), rng.uniform(0, 5e7))
                 for _ in range(S - 1)]
        prof = PipelineProfile(S, N, [rng.uniform(1, 9) for _ in range(S)], [rng.uniform(1, 9) for _ in range(S)],
                               [rng.uniform(0, 5) for _ in range(S)], tuple(links))
        x = zb_h1_warmup_counts(S) if rng.random() < 0.5 else [min(N, 2 * (S - i)) for i in range(S)]
        order = generate_order(prof.with_links(()), x, x, full_backward=rng.random() < 0.3).order
        ns = replay_makespan_ns(order, prof)
        assert ns == to_ns(simulate(order, prof).makespan_ms)
        assert replay_makespan_ns(order, prof, bound_ns=ns) == ns
        assert replay_makespan_ns(order, prof, bound_ns=ns - 1) is None


def test_hold_bound_is_a_lower_bound():
    """The Little's-law bound that lets the planner skip candidates never exceeds a plan's simulated
    makespan (plans capped at their warm-up counts, static or generated, split or full backward)."""
    from titan_ext.plan.pipemorph import hold_bound_ns

    rng = random.Random(99)
    for _ in range(200):
        prof = hetero_case(rng)
        S, N = prof.num_stages, prof.num_microbatches
        x = sorted((rng.randint(1, N) for _ in range(S)), reverse=True)
        full = rng.random() < 0.3
        model = prof.fused() if full else prof
        order = generate_order(rng.choice([prof, prof.with_links(())]), x, x, full_backward=full).order
        assert hold_bound_ns(model, x) <= to_ns(simulate(order, prof).makespan_ms)


def test_slack_floor1_and_notes():
    """The memory extension keeps S=8, N=32, t=10, +60 ms on link 6 at 1090 ms with stage 0 ≤ 14 even
    among the candidates; Alg.2 without room (N ≤ 2S) says so; a memory-free uniform case is ZB's."""
    prof = PipelineProfile.uniform(8, 32, 10.0, 10.0, 10.0, delays_ms={6: 60.0})
    plan = plan_pipemorph(prof, slack_floor=1)
    assert plan.predicted_makespan_ms == pytest.approx(1090.0)
    assert plan.peak_inflight[0] <= 14 and plan.notes == []
    tight = plan_pipemorph(PipelineProfile.uniform(4, 8, 10.0, 10.0, 10.0, delays_ms={1: 30.0}))
    assert any("N = 8 <= 2S = 8" in n for n in tight.notes)
    fig4 = plan_pipemorph(PipelineProfile.uniform(4, 12, 10.0, 10.0, 10.0), memory_limit=7)
    assert fig4.predicted_makespan_ms == pytest.approx(390.0)


# ------------------------------------------------------------------ validators: ours vs torch's
def _torch_accepts(ops, S: int, N: int, limit: int | None) -> bool:
    """torch's second opinion: its own checker, SEND/RECV lowering and dry run; the in-flight count is
    taken on torch's actions (torch has no memory limit of its own)."""
    sched = torch_schedules()
    actions = to_torch_plan(ops)
    if limit is not None:
        for rank_actions in actions.values():
            held = 0
            for a in rank_actions:
                held += {sched.F: 1, sched.I: -1, sched.B: -1}.get(a.computation_type, 0)
                if held > limit:
                    return False
    stage_to_rank = {s: s for s in range(S)}.__getitem__
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            sched._validate_schedule(actions, len(actions), S, N)
            lowered = sched._add_send_recv(actions, stage_to_rank=stage_to_rank, num_stages=S)
            sched._simulate_comms_compute(lowered, stage_to_rank=stage_to_rank, num_stages=S)
    except Exception:
        return False
    return True


def test_validators_agree_on_2000_random_plans():
    rng = random.Random(2000)
    verdicts: dict[tuple[str, bool], int] = {}
    for _ in range(2000):
        S = rng.randint(2, 5)
        N = rng.randint(S, 2 * S)
        prof = PipelineProfile(S, N, [rng.uniform(1, 5) for _ in range(S)], [rng.uniform(1, 5) for _ in range(S)],
                               [rng.uniform(1, 5) for _ in range(S)]).with_delays({rng.randrange(S - 1): rng.uniform(0, 20)})
        x = sorted((rng.randint(1, N) for _ in range(S)), reverse=True)
        base = generate_order(prof, x, rng.choice([None, x]), full_backward=rng.random() < 0.25).order
        kind, ops, limit = _mutate(rng, base, S)
        try:
            validate_plan(ops, S, N, inflight_limit=limit)
            ours = True
        except PlanValidationError:
            ours = False
        assert ours == _torch_accepts(ops, S, N, limit), (kind, ops, limit)
        verdicts[(kind, ours)] = verdicts.get((kind, ours), 0) + 1
    for kind in ("drop", "swap-dep", "reorder", "memory"):
        assert verdicts.get((kind, False), 0) > 50, verdicts  # every kind of breakage really happens
    assert verdicts.get(("valid", True), 0) > 300
    assert verdicts.get(("reorder", True), 0) > 0  # and harmless reorders are accepted by both


def test_validate_torch_is_opt_in(monkeypatch):
    """The hot path never calls torch's dry run; validate="torch" does."""
    sched = torch_schedules()
    calls = []
    real = sched._simulate_comms_compute
    monkeypatch.setattr(sched, "_simulate_comms_compute", lambda *a, **k: calls.append(1) or real(*a, **k))
    prof = PipelineProfile.uniform(4, 8, 10.0, 10.0, 10.0, delays_ms={1: 20.0})
    plan_pipemorph(prof)
    assert calls == []
    strict = plan_pipemorph(prof, validate="torch")
    assert calls == [1]
    assert as_ops(strict.actions) == strict.ops


def test_auto_is_the_faster_of_pipemorph_and_crosspipe():
    """plan_by_name("auto") ≤ both planners (each timed by the reference simulator), validated, within
    the memory limit; on few microbatches (N ≤ 2S) it is where CrossPipe can win."""
    from titan_ext.plan.crosspipe import plan_crosspipe
    from titan_ext.plan.schedules import plan_by_name

    rng = random.Random(5)
    for case in range(12):
        S = rng.randint(3, 6)
        N = rng.choice([S, 2 * S])
        prof = PipelineProfile(S, N, [rng.uniform(5, 15) for _ in range(S)], [rng.uniform(5, 15) for _ in range(S)],
                               [rng.uniform(2, 8) for _ in range(S)]).with_delays({rng.randrange(S - 1): rng.uniform(5, 60)})
        K = None if case % 3 else S
        auto = plan_by_name(prof, "auto", memory_limit=K)
        tl = simulate(auto.actions, prof)
        assert tl.makespan_ms == pytest.approx(auto.predicted_makespan_ms, abs=1e-6)
        validate_plan(auto.actions, S, N, inflight_limit=K, torch_dry_run=True)
        pm = simulate(plan_pipemorph(prof, memory_limit=K).actions, prof).makespan_ms
        cp = simulate(plan_crosspipe(prof, "ud", memory_limit=K).actions, prof).makespan_ms
        assert tl.makespan_ms <= min(pm, cp) + 1e-6


def test_cli_auto_strict_and_note(capsys):
    from titan_ext.cli import main

    assert main(["plan", "--stages", "4", "--microbatches", "8", "--times", "10,10,10", "--delay", "2:30",
                 "--schedule", "auto", "--strict", "--memory-limit", "6", "--json"]) == 0
    import json

    captured = capsys.readouterr()  # --json: stdout is the JSON alone, the note goes to stderr
    assert captured.err.strip().splitlines()[0].startswith("note: Alg.2 has no room: N = 8 <= 2S = 8")
    out = json.loads(captured.out)
    assert out["validated_by"] == "ours+torch" and max(out["peak_inflight"].values()) <= 6
    assert out["makespan_ms"] == pytest.approx(out["predicted_makespan_ms"])


def _held(order) -> int:
    """Activations a plan holds when nothing stretches it: per stage, the forwards before its first backward
    (counted here from the order, not by the library's ``warmup_counts_of``)."""
    total = 0
    for ops in order.values():
        first = next(j for j, (_, kind, _) in enumerate(ops) if kind in ("B", "I"))
        total += sum(1 for _, kind, _ in ops[:first] if kind == "F")
    return total


def test_hold_margin_deploys_torchs_1f1b_where_a_deeper_warm_up_is_a_fraction_faster():
    """Measured-looking times, no delay to absorb, 1F1B's memory on stages 1-3: the model times a deeper
    stage-0 warm-up 0.6 % faster than 1F1B's own counts; with a 1 % margin the plan is torch's 1F1B order
    (``Schedule1F1B``'s own actions), without it the deeper one."""
    prof = PipelineProfile(4, 16, (2.4, 2.2, 2.3, 2.5), (2.5, 2.4, 2.6, 2.3),
                           (2.3, 2.5, 2.2, 2.4)).with_delays({0: 0.3, 1: 0.3, 2: 0.3})
    one_f_one_b = as_ops(builtin_plan("1F1B", 4, 16)[0])
    exact = plan_pipemorph(prof, memory_limit=[16, 3, 3, 2], backward="full")
    lean = plan_pipemorph(prof, memory_limit=[16, 3, 3, 2], backward="full", hold_margin=0.01)
    fast_ms, ofob_ms = (simulate(p, prof.fused()).makespan_ms for p in (exact.ops, one_f_one_b))
    assert fast_ms < ofob_ms < 1.01 * fast_ms and _held(exact.ops) > _held(one_f_one_b)
    assert as_ops(lean.ops) == one_f_one_b and as_ops(exact.ops) != one_f_one_b


@pytest.mark.parametrize("seed", range(4))
def test_hold_margin_is_within_the_margin_of_the_fastest_and_never_holds_more(seed):
    """Random heterogeneous profiles, half without a delay, some with a memory limit: the plan with a
    margin is within that margin of the plan without (and of the paper's plans: ``baselines``), and holds
    no more activations than it; every makespan from the reference simulator."""
    rng = random.Random(1000 + seed)
    for _ in range(25):
        prof = hetero_case(rng)
        if rng.random() < 0.5:
            prof = prof.with_links(())
        limit = rng.choice([None, max(2, prof.num_stages // 2)])
        for backward in ("split", "full"):
            timed = prof.fused() if backward == "full" else prof
            exact = plan_pipemorph(prof, memory_limit=limit, backward=backward)
            lean = plan_pipemorph(prof, memory_limit=limit, backward=backward, hold_margin=0.02)
            exact_ms, lean_ms = (simulate(p.ops, timed).makespan_ms for p in (exact, lean))
            assert lean_ms <= 1.02 * exact_ms + 1e-6 and _held(lean.ops) <= _held(exact.ops)
            if limit is None and backward == "split":
                assert lean_ms <= 1.02 * min(baselines(prof).values()) * 1.001
