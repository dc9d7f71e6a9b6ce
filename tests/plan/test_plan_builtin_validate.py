"""torch's built-in schedules simulated against closed forms; the validator rejects broken plans."""

import pytest

from titan_ext.plan import PipelineProfile, PlanValidationError, simulate, validate_plan
from titan_ext.plan.builtin import BUILTINS, builtin_plan


@pytest.mark.parametrize("S, N", [(2, 4), (4, 8), (4, 12), (8, 16), (3, 9)])
def test_1f1b_closed_form(S, N):
    """1F1B with uniform t_F = t and full backward t_B + t_W = 2t, no delay. The last stage starts at
    (S−1)t and then alternates F, B without a gap (N·3t); the last backward then walks back through
    S−1 stages (S−1)·2t. T = (S−1)t + 3Nt + 2(S−1)t = (N + S − 1)(t_F + t_B + t_W)."""
    t = 10.0
    plan, _ = builtin_plan("1F1B", S, N)
    validate_plan(plan, S, N)
    assert simulate(plan, PipelineProfile.uniform(S, N, t, t, t)).makespan_ms == pytest.approx((N + S - 1) * 3 * t)


def test_plan_builtin_is_a_plan_result():
    """torch's built-ins through the one result type: 1F1B's closed form, its memory x_i = S − i."""
    from titan_ext.plan.builtin import plan_builtin

    res = plan_builtin("1f1b", PipelineProfile.uniform(4, 8, 10.0, 10.0, 10.0))
    assert res.schedule == "1F1B" and res.predicted_makespan_ms == pytest.approx((8 + 4 - 1) * 30.0)
    assert res.warmup_counts == [4, 3, 2, 1] and res.peak_inflight == {0: 4, 1: 3, 2: 2, 3: 1}
    zbv = plan_builtin("ZBVZeroBubble", PipelineProfile.uniform(4, 8, 10.0, 10.0, 10.0))
    assert zbv.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)  # torch's own "v" mapping, as plan.placement has it
    validate_plan(zbv.actions, 8, 8)


@pytest.mark.parametrize("S, N", [(2, 4), (4, 8), (4, 12), (8, 16), (3, 9), (4, 24)])
def test_zbv_closed_form(S, N):
    """ZBV (two chunks per rank, V shape), each rank's model split evenly so a chunk takes t/2 for each
    of F, I, W. ZBV is bubble-free after the fill (ZB paper §6): rank S−1 can first compute once
    microbatch 0 has crossed S−1 chunks, (S−1)·t/2, and then runs its 3N·t of work without a gap.
    T = 3N·t + (S−1)·t/2."""
    t = 10.0
    plan, placement = builtin_plan("ZBVZeroBubble", S, N)
    assert len(placement) == 2 * S
    validate_plan(plan, 2 * S, N)
    tl = simulate(plan, PipelineProfile.uniform(S, N, t, t, t))
    assert tl.makespan_ms == pytest.approx(3 * N * t + (S - 1) * t / 2)


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_every_builtin_validates_and_delays_hurt(name):
    plan, placement = builtin_plan(name, 4, 8)
    validate_plan(plan, len(placement), 8)
    prof = PipelineProfile.uniform(4, 8, 10, 10, 10)
    slow = prof.with_delays({1: 30})
    base = simulate(plan, prof).makespan_ms
    assert simulate(plan, slow).makespan_ms > base
    # HOL blocking never helps
    assert simulate(plan, slow, hol=True).makespan_ms >= simulate(plan, slow).makespan_ms


def test_hol_hand_computed():
    """Two stages, N=2, plan 0: F0 F1 I0 I1 W0 W1 / 1: F0 I0 F1 I1 W0 W1, t=10, c=25 on link 0.
    Delegated: stage 1 gets F0 at 35, F1 at 45 → F0 35-45, I0 45-55, F1 55-65, I1 65-75, W 75-95;
    stage 0: I0 needs grad at 55+25=80 → 80-90, I1 at max(90, 75+25) → 100-110, W0 110-120, W1 120-130.
    HOL: stage 0's F0 send holds it until 35 (delivery), F1 runs 35-45, held until 70;
    stage 1: F0 35-45, I0 45-55 (send held until 80), F1 80-90 (arrived 70), I1 90-100 (held to 125),
    W0 125-135, W1 135-145; stage 0: I0 at 80-90, I1 needs 100+25=125 → 125-135, W 135-155."""
    plan = {
        0: [(0, "F", 0), (0, "F", 1), (0, "I", 0), (0, "I", 1), (0, "W", 0), (0, "W", 1)],
        1: [(1, "F", 0), (1, "I", 0), (1, "F", 1), (1, "I", 1), (1, "W", 0), (1, "W", 1)],
    }
    prof = PipelineProfile.uniform(2, 2, 10, 10, 10, delays_ms={0: 25})
    assert simulate(plan, prof).makespan_ms == pytest.approx(130.0)
    assert simulate(plan, prof, hol=True).makespan_ms == pytest.approx(155.0)


def test_bandwidth_queueing_hand_computed():
    """Latency 5 ms and 15 ms on the wire per message; stage 0 sends forwards at 10, 20, 30.
    One message per direction at a time: windows 10-25, 25-40, 40-55 → arrivals 30, 45, 60.
    Without queueing (a pure 20 ms delay) they would arrive at 30, 40, 50."""
    from titan_ext.plan import LinkProfile

    link = LinkProfile(latency_ms=5, bandwidth_bytes_per_s=1e9, message_bytes=15e6)
    assert link.delay_ms == pytest.approx(20.0)
    plan = {0: [(0, "F", m) for m in range(3)] + [(0, k, m) for m in range(3) for k in "IW"],
            1: [(1, "F", m) for m in range(3)] + [(1, k, m) for m in range(3) for k in "IW"]}
    for prof, expected in (
        (PipelineProfile(2, 3, 10, 10, 10, (link,)), [30.0, 45.0, 60.0]),
        (PipelineProfile.uniform(2, 3, 10, 10, 10, delays_ms={0: 20}), [30.0, 40.0, 50.0]),
    ):
        starts = {(e.stage, e.kind, e.microbatch): e.start_ms for e in simulate(plan, prof).events}
        assert [starts[(1, "F", m)] for m in range(3)] == pytest.approx(expected)


def good_plan():
    return {
        0: [(0, "F", 0), (0, "F", 1), (0, "I", 0), (0, "W", 0), (0, "I", 1), (0, "W", 1)],
        1: [(1, "F", 0), (1, "I", 0), (1, "F", 1), (1, "I", 1), (1, "W", 0), (1, "W", 1)],
    }


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda p: p[0].remove((0, "W", 1)), "no W"),
        (lambda p: p[1].append((1, "F", 0)), "appears 2 times"),
        (lambda p: p[0].insert(0, p[0].pop(2)), "comes before"),
        (lambda p: p[1].append((1, "F", 5)), "out of range"),
        (lambda p: p[1].append((0, "W", 0)), "ranks"),
        (lambda p: p.__setitem__(1, [(1, "I", 0), (1, "F", 0)] + p[1][2:]), "comes before"),
        # cross-rank deadlock: stage 1 wants microbatch 1's F first, stage 0 sends 0 first but waits
        # on I0 from stage 1 before F1.
        (lambda p: p.__setitem__(0, [(0, "F", 0), (0, "I", 0), (0, "F", 1), (0, "W", 0), (0, "I", 1), (0, "W", 1)])
         or p.__setitem__(1, [(1, "F", 1), (1, "F", 0), (1, "I", 0), (1, "I", 1), (1, "W", 0), (1, "W", 1)]),
         "deadlock"),
    ],
)
def test_validator_rejects(mutate, reason):
    plan = good_plan()
    validate_plan(plan, 2, 2)
    mutate(plan)
    with pytest.raises(PlanValidationError, match=reason):
        validate_plan(plan, 2, 2)


def test_validator_memory_limit():
    validate_plan(good_plan(), 2, 2, inflight_limit=2)
    with pytest.raises(PlanValidationError, match="above its limit"):
        validate_plan(good_plan(), 2, 2, inflight_limit=1)


def test_torch_dry_run_is_consulted(monkeypatch):
    """A plan our checks accept but torch's dry run rejects is rejected (simulated torch failure)."""
    from titan_ext.plan import ir

    sched = ir.torch_schedules()

    def refuse(*a, **k):
        raise ValueError("Schedule is not progressing")

    monkeypatch.setattr(sched, "_simulate_comms_compute", refuse)
    validate_plan(good_plan(), 2, 2)  # the hot path: our checks only
    with pytest.raises(PlanValidationError, match="torch"):
        validate_plan(good_plan(), 2, 2, torch_dry_run=True)


def test_torch_dry_run_on_a_lowered_plan():
    """The lowered-plan dry run (what the runtime executes) accepts torch's own lowering of a valid plan,
    with the FSDP passes included, and rejects it once rank 0 waits for a gradient before its first
    forward (the gradient can never come)."""
    from titan_ext.plan import ir
    from titan_ext.plan.builtin import builtin_plan
    from titan_ext.plan.validate import torch_dry_run_lowered

    sched = ir.torch_schedules()
    actions, mapping = builtin_plan("1F1B", 2, 4)
    lowered = {r: sched._add_reduce_grad(sched._add_unshard_reshard(list(a)), 4) for r, a in actions.items()}
    lowered = sched._add_send_recv(lowered, stage_to_rank=mapping.__getitem__, num_stages=2)
    lowered = getattr(sched, "_add_wait_send", lambda w: w)(lowered)  # torch >= 2.15's send waits
    torch_dry_run_lowered(lowered, mapping, 2)
    rank0 = lowered[0]
    recv_b = [i for i, a in enumerate(rank0) if a.computation_type == sched._ComputationType.RECV_B]
    first_f = next(i for i, a in enumerate(rank0) if a.computation_type == sched._ComputationType.FORWARD)
    rank0.insert(first_f, rank0.pop(recv_b[0]))  # rank 0 waits for a gradient before its first forward
    with pytest.raises(PlanValidationError, match="lowered plan"):
        torch_dry_run_lowered(lowered, mapping, 2)
