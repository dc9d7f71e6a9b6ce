"""Falcon §7.3's compound sequence on the monitor and the job's decision logic (a host model): a slow DP link → S3, then a slow device → S2, then the device stays slow → S4, each
``falcon_events.jsonl`` row with its evidence; and the classifier that makes it possible (a slow link
that does not touch the flagged device is the link's, and the component not handled yet gives the
root cause). Pure: a host model of a DP 2 × PP 2 job, no processes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from titan_ext.runtime.falcon import FalconConfig, FalconMonitor, IterationObservation, StrategyCosts
from titan_ext.runtime.falcon.attribution import attribute


def test_a_slow_link_not_touching_the_slow_device_is_the_links():
    grid = [[0, 2], [1, 3]]  # TorchTitan's DP 2 x PP 2: pipelines {0, 2}, {1, 3}; DP groups {0, 1}, {2, 3}
    link, device = [(0, 1), (1, 0)], [3]
    att = attribute(link, device, grid)
    assert [(c.label(), c.cause) for c in att.components] == [("link 0-1", "dp_link"), ("device 3", "compute")]
    assert att.root_cause == "dp_link"  # nothing handled yet: the link first (as before)
    # once the link was handled (S3 moved it), the device gives the root cause although the link is
    # still slow (the old rule: any slow link not on a slow device decided the cause, "dp_link" here)
    assert attribute(link, device, grid, handled={(0, 1)}).root_cause == "compute"
    moved = [[0, 1], [2, 3]]  # after S3: 0-1 a PP hop of pipeline 0
    att = attribute(link, device, moved, handled={(0, 1)})
    assert [(c.label(), c.cause, c.handled) for c in att.components] == [
        ("link 0-1", "pp_link", True), ("device 3", "compute", False)]
    assert att.root_cause == "compute" and att.root.label() == "device 3"
    # a slow link with the slow device at one end is the device's (it delays its own messages)
    att = attribute([(1, 3), (3, 1)], device, grid)
    assert [(c.label(), c.cause) for c in att.components] == [("device 3", "compute")]
    # all handled: the first component's cause; nothing found: none
    assert attribute(link, device, grid, handled={(0, 1), (3,)}).root_cause == "dp_link"
    assert attribute([], [], grid).root is None


F, C, LINK_ON_DP, LINK_ON_PP, FACTOR = 0.2, 0.1, 1.0, 0.1, 8.0
COSTS = StrategyCosts(microbatch_redistribution=0.5, topology_adjustment=2.0, checkpoint_restart=40.0)
LINK_FROM, DEVICE_FROM, STEPS = 60, 130, 260


def _host(it: int, grid, split) -> tuple[float, list[float], dict, dict]:
    """The DP 2 × PP 2 job on devices of their own: replica i's chunk time ``t_i`` (device 3 slow ×8
    from DEVICE_FROM), its step ``F + max(m_i t_i)`` plus the slow link 0-1 (from LINK_FROM) at its
    place in the grid: inside a DP group it holds the gradient sum (+1 s), on a PP hop the
    activations only (+0.1 s). Returns (step, t_i, validation's link times, GEMM probe times)."""
    slow_dev = it >= DEVICE_FROM
    t = [C * (FACTOR if slow_dev and 3 in row else 1.0) for row in grid]
    step = F + max(m * x for m, x in zip(split, t))
    if it >= LINK_FROM:
        on_pp = any(abs(row.index(0) - row.index(1)) == 1 for row in grid if 0 in row and 1 in row)
        step += LINK_ON_PP if on_pp else LINK_ON_DP
    links = {(a, b): (0.05 if {a, b} == {0, 1} and it >= LINK_FROM else 0.001)
             for a, b in [(0, 1), (1, 0), (2, 3), (3, 2), (0, 2), (2, 0), (1, 3), (3, 1)]}
    gemm = {r: 0.01 * (FACTOR if r == 3 and slow_dev else 1.0) for r in range(4)}
    return step, t, links, gemm


def test_compound_sequence_s3_then_s2_then_s4_with_evidence_rows(tmp_path):
    """Falcon §7.3 (Fig. 17: throughput 1.7 → 1.0 by slow communication, S3 → 1.3; a GPU slows,
    0.5, S2 → 0.9; then checkpoint-restart once the impact passes its threshold). The job's part is
    the real one — :func:`~titan_ext.runtime.falcon.apply.plan_changes` decides what a decision
    changes, the grid and the split follow it, :func:`~titan_ext.titan.falcon_events.event_rows`
    and :class:`~titan_ext.titan.falcon_events.EventLog` write the rows — on a host model whose
    steps follow the layout. Order S3 < S2 < S4 (applied), each at the iteration the ski rental
    gives (recomputed here from the logged times), and every row's evidence."""
    from _falcon_model import apply_on_model

    from titan_ext.runtime.falcon.apply import JobView, plan_changes
    from titan_ext.titan.falcon_events import EventLog, event_rows

    grid, split, even = [[0, 2], [1, 3]], [3, 3], [3, 3]
    mon = FalconMonitor(FalconConfig(costs=COSTS, num_microbatches=6, slow_device_ratio=1.5),
                        grid=grid, pp_groups={"pp0_link0": 0, "pp1_link0": 0}, dp_groups=["dp_stage0", "dp_stage1"])
    trainer = SimpleNamespace(step=0)
    log = EventLog(trainer, tmp_path, rank=0)
    rng = np.random.default_rng(35)
    applied, times = [], []
    for it in range(STEPS):
        trainer.step = it
        step, t, links, gemm = _host(it, grid, split)
        noisy = step * (1 + 0.01 * rng.standard_normal())
        times.append(noisy)
        decision = mon.observe(IterationObservation(noisy, replica_microbatch_s=t, split=split))
        if decision.validate:
            decision = decision.with_metrics(mon.report_validation(links, gemm))
        estimated = mon.config.costs
        view = JobView(step=it, split=tuple(split), even_split=tuple(even), grid=tuple(map(tuple, grid)),
                       replanning_on=True, checkpoint_enabled=True)
        changes = plan_changes(decision, view, mon)
        split, grid, names = apply_on_model(changes, split, grid, even, mon)
        applied_s = {name: 0.0 if name != "checkpoint_restart" else None for name in names}
        applied += [(it, name) for name in names if name != "ignore"]
        decision = decision.with_metrics(changes.metrics)
        log.record(dict(decision), event_rows(it, decision, mon, estimated, applied_s, True))
        if changes.s4_plan is not None:
            s4_plan = changes.s4_plan
            break
    else:
        pytest.fail(f"no S4 in {STEPS} iterations; applied {applied}")

    rows = [json.loads(line) for line in (tmp_path / "falcon_events.jsonl").read_text().splitlines()]
    assert len((tmp_path / "falcon.jsonl").read_text().splitlines()) == it + 1  # every step logged once
    order = [name for _, name in applied]
    assert order == ["topology_adjustment", "microbatch_redistribution", "checkpoint_restart"], applied
    (i3, _), (i2, _), (i4, _) = applied
    assert LINK_FROM < i3 < DEVICE_FROM < i2 < i4

    # localisation: first the DP link (its own fault), then, re-localised during the same event,
    # the device — the link still slow, now a PP hop, handled — with the measures as evidence
    loc = [r for r in rows if r["kind"] == "localised"]
    assert [r["suspected"]["root_cause"] for r in loc] == ["dp_link", "compute"]
    assert loc[0]["evidence"]["components"] == [
        {"component": "link 0-1", "cause": "dp_link", "measure": pytest.approx(0.049), "handled": False}]
    second = loc[1]["evidence"]["components"]
    assert [(c["component"], c["cause"], c["handled"]) for c in second] == [
        ("link 0-1", "pp_link", True), ("device 3", "compute", False)]
    assert second[1]["measure"] == pytest.approx(FACTOR, rel=0.01)  # probe time / median
    assert loc[0]["iteration"] < i3 and i3 < loc[1]["iteration"] < i2
    events = [r for r in rows if r["kind"] == "event"]
    assert events[0]["event"] == "onset" and LINK_FROM <= events[0]["change_point_iteration"] <= LINK_FROM + 1
    assert events[0]["evidence"]["relative_change"] > 0.5
    relocated = [r for r in events if r["iteration"] == loc[1]["iteration"]]
    assert relocated and relocated[0]["event"] == "level" and relocated[0]["evidence"]["relative_change"] > 0.5
    assert not any(r["event"] == "relief" for r in events)  # one event throughout

    # decisions: S3 for the link, S2 and S4 for the device; an S3 in the device's ladder keeps the
    # grid (the link is on a PP hop already) and is recorded as not applied
    dec = [r for r in rows if r["kind"] == "decision"]
    got = [(r["iteration"], r["strategy"], r["applied"], r["evidence"]["component"]) for r in dec if r["strategy"] != "S1"]
    assert (i3, "S3", True, "link 0-1") in got and (i2, "S2", True, "device 3") in got
    assert (i4, "S4", True, "device 3") in got
    assert any(s == "S3" and not a and c == "device 3" for _, s, a, c in got)
    for r in dec:  # Alg. 1's evidence: the impact so far reached the strategy's cost
        assert r["evidence"]["impact_s"] >= r["evidence"]["estimated_cost_s"] - 1e-9, r
    s4_row = next(r for r in dec if r["strategy"] == "S4")
    assert s4_row["evidence"]["iteration_time_predicted_s"] < s4_row["iteration_time_before_s"]  # it pays

    # the ski rental recomputed from the logged times: healthy = median before the onset, the
    # impact summed from the change-point; S3 at the first iteration after the link's localisation
    # where it reaches S3's cost, S2 likewise after the re-localisation, S4 where it reaches S4's
    cp = events[0]["change_point_iteration"]
    healthy = float(np.median(times[:cp]))
    acc = np.cumsum([x - healthy for x in times[cp:]])
    first = lambda cost, after: next(cp + k for k, a in enumerate(acc) if a >= cost and cp + k > after)  # noqa: E731
    assert abs(i3 - first(COSTS.topology_adjustment, loc[0]["iteration"])) <= 1
    assert i2 == loc[1]["iteration"] + 1  # the impact so far passed S2's cost long ago: at once
    assert abs(i4 - first(COSTS.checkpoint_restart, loc[1]["iteration"])) <= 1
    # S4 without a spare: device 3's replica leaves, the other takes all 6 chunks
    assert s4_plan.excluded == [3] and s4_plan.kept_replicas == [0] and s4_plan.chunks_per_replica == 6
    # the steps followed the mitigations: S3 took the link's cost off the step, S2 most of the device's
    assert np.median(times[i3 + 2:DEVICE_FROM]) < 0.5 * np.median(times[LINK_FROM + 1:i3])
    assert np.median(times[i2 + 2:i4]) < 0.5 * np.median(times[DEVICE_FROM + 1:i2])


def test_s3_hands_the_moved_link_to_pipemorph_with_delegation():
    """PipeMorph §7.3 (Fig. 19): Falcon's S3 turns a slow DP link into a PP hop; with
    ``falcon_delegation`` the job then re-plans and delegates that hop's pipeline. DP 2 × PP 4
    (TorchTitan's mesh: pipelines {0,2,4,6}, {1,3,5,7}), DP link 0-1 slow."""
    from titan_ext.runtime.falcon import FalconDecision, plan_topology
    from titan_ext.runtime.falcon.apply import JobView, plan_changes, pp_hops

    grid = [[0, 2, 4, 6], [1, 3, 5, 7]]
    mon = FalconMonitor(FalconConfig(), grid=grid)
    mon.report_validation({(0, 1): 0.05, (1, 0): 0.05, (2, 3): 0.001, (3, 2): 0.001}, {r: 0.01 for r in range(8)})
    assert mon.root_cause == "dp_link"
    plan = plan_topology(grid, mon.slow_links, [])
    new = [list(r) for r in plan.grid]
    assert plan.moved > 0 and pp_hops(mon.slow_links, new) == ((0, 1),)
    decision = FalconDecision(9, {"falcon/apply": "topology_adjustment", "falcon/plan/topology_grid": json.dumps(new)})
    view = JobView(step=9, split=(3, 3), even_split=(3, 3), grid=tuple(map(tuple, grid)), replanning_on=False,
                   checkpoint_enabled=False)
    frozen = plan_changes(decision, view, mon)  # the schedule stays frozen: S3 alone
    assert frozen.grid == tuple(map(tuple, new)) and not frozen.replan and frozen.delegate_links == ()
    handed = plan_changes(decision, JobView(**{**view.__dict__, "delegate_after_s3": True}), mon)
    assert handed.grid == frozen.grid and handed.replan and handed.delegate_links == ((0, 1),)
    assert json.loads(handed.metrics["falcon/plan/delegate_links"]) == [[0, 1]]
    # a plan that keeps the grid hands nothing over
    kept = FalconDecision(9, {"falcon/apply": "topology_adjustment", "falcon/plan/topology_grid": json.dumps(grid)})
    assert plan_changes(kept, JobView(**{**view.__dict__, "delegate_after_s3": True}), mon).delegate_links == ()


def test_the_job_delegates_the_moved_links_pipeline_through_the_schedules_delegation():
    """``FalconJob._delegate`` on a schedule whose transport is the real :class:`Delegation` ("auto"):
    the pipeline holding the moved link delegates from this boundary (before, the job looked for a
    ``set_delegation`` method no schedule has, logged "no delegates" and delegated nothing while the
    bench still reported the link as delegated); the other pipeline does not."""
    from titan_ext.runtime.control.config import DelegationConfig
    from titan_ext.runtime.comm.delegate.schedule import Delegation
    from titan_ext.runtime.control.observers import ScheduleContext
    from titan_ext.titan.falcon_job import FalconJob

    def job(dp_index):
        log: list = []
        delegation = Delegation(DelegationConfig(mode="auto", slow_link_ms=1e6))
        delegation.attach(ScheduleContext(
            name="PipeMorph", group=None, num_stages=4, n_microbatches=16, control=None, device=lambda: None,
            stage_to_rank=lambda: {s: s for s in range(4)}, iteration=lambda: 9, in_iteration=lambda: False,
            log=lambda **kw: log.append(kw) or kw, adaptive=lambda: True, enable_adaptation=lambda who, why: None))
        schedule = SimpleNamespace(adaptive=False, delegation=delegation)
        return SimpleNamespace(trainer=SimpleNamespace(pp_schedule=schedule), grid=[[0, 1, 4, 6], [2, 3, 5, 7]],
                               dp_index=dp_index, delegated_links=[]), log

    holder, log = job(0)
    FalconJob._delegate(holder, ((0, 1),))
    assert holder.trainer.pp_schedule.delegation.delegating and holder.trainer.pp_schedule.adaptive
    assert holder.delegated_links == [(0, 1)] and log and log[-1]["decision"] == "delegation"
    assert holder.trainer.pp_schedule.delegation.links == {frozenset((0, 1))}
    other, _ = job(1)
    FalconJob._delegate(other, ((0, 1),))
    assert not other.trainer.pp_schedule.delegation.delegating and other.delegated_links == []
    assert other.trainer.pp_schedule.adaptive  # re-planning on everywhere


def test_latency_fault_through_a_bounded_window_costs_a_gradient_many_round_trips():
    """``window_bytes``: a transfer of n bytes over a link with MS of added latency pays
    ceil(n / window) × MS; unbounded (the default, and every test before it): MS once."""
    from titan_ext.runtime.falcon.emulation import FailSlowEmulation, parse_slow_link

    link = parse_slow_link("0-1:30")
    plain = FailSlowEmulation(0, range(4), slow_link=link)
    windowed = FailSlowEmulation(0, range(4), slow_link=link, window_bytes=256 * 1024)
    grad = 3_000_000  # a stage's ring step of 3 MB: 12 windows of 256 KiB
    assert plain.collective_delay_s([0, 1], 2, step_bytes=grad) == pytest.approx(2 * 0.030)
    assert windowed.collective_delay_s([0, 1], 2, step_bytes=grad) == pytest.approx(2 * 12 * 0.030)
    assert windowed.send_delay_s(0, 1, 64 * 1024) == pytest.approx(0.030)  # an activation: once
    assert windowed.send_delay_s(0, 2, grad) == 0.0  # not the slow link
    assert windowed.collective_delay_s([2, 3], 2, step_bytes=grad) == 0.0


def test_s3_plan_out_of_rank_order_falls_back_to_the_root_link_alone():
    """Seen in the Fig. 19 bench (2026-11-27): validation on a loaded host also flagged DP link 4-5;
    the plan for both links put a pipeline out of global-rank order ([5, 4, 2, 7]), which the
    in-memory S3 refuses (torch numbers a PP group by global rank) — and the job died. The job now
    plans S3 for the root component alone, or applies nothing."""
    from titan_ext.runtime.falcon import FalconDecision, plan_topology
    from titan_ext.runtime.falcon.apply import JobView, plan_changes

    grid = [[0, 2, 4, 6], [1, 3, 5, 7]]
    mon = FalconMonitor(FalconConfig(), grid=grid)
    links = {(0, 1): 0.05, (1, 0): 0.05, (4, 5): 0.03, (5, 4): 0.03, (2, 3): 0.001, (3, 2): 0.001}
    mon.report_validation(links, {r: 0.01 for r in range(8)}, link_reference_s=0.001)  # the job's reference ring
    assert mon.root_cause == "dp_link" and mon.root_key == (0, 1) and len(mon.slow_links) == 4
    both = plan_topology(grid, mon.slow_links, [])
    view = JobView(step=8, split=(2, 2), even_split=(2, 2), grid=tuple(map(tuple, grid)), replanning_on=False,
                   checkpoint_enabled=False)
    unordered = [[0, 1, 4, 6], [5, 4, 2, 7]]  # the bench's plan (any grid with a pipeline out of order)
    decision = FalconDecision(8, {"falcon/apply": "topology_adjustment",
                                  "falcon/plan/topology_grid": json.dumps(unordered)})
    changes = plan_changes(decision, view, mon)
    alone = plan_topology(grid, [(0, 1), (1, 0)], []).grid
    assert changes.grid == tuple(map(tuple, alone)) and all(list(r) == sorted(r) for r in changes.grid)
    assert changes.applied == ("topology_adjustment",) and "out of global-rank order" in changes.notes[0][1]
    assert both.moved > 0  # (the monitor's own two-link plan, whatever its order)


def test_only_the_root_link_is_delegated_after_s3():
    """The Fig. 19 run's delegating arm: validation also flagged 3->2 (noise); S3's grid put 2-3 on
    a PP hop too and both pipelines delegated. Only the root component's link is delegated now."""
    from titan_ext.runtime.falcon import FalconDecision
    from titan_ext.runtime.falcon.apply import JobView, plan_changes

    grid = [[0, 2, 4, 6], [1, 3, 5, 7]]
    mon = FalconMonitor(FalconConfig(), grid=grid)
    mon.report_validation({(0, 1): 0.05, (1, 0): 0.05, (3, 2): 0.02, (2, 3): 0.001, (4, 5): 0.001},
                          {r: 0.01 for r in range(8)}, link_reference_s=0.001)
    assert (3, 2) in mon.slow_links and mon.root_key == (0, 1)
    new = [[0, 1, 4, 6], [2, 3, 5, 7]]
    decision = FalconDecision(9, {"falcon/apply": "topology_adjustment", "falcon/plan/topology_grid": json.dumps(new)})
    view = JobView(step=9, split=(2, 2), even_split=(2, 2), grid=tuple(map(tuple, grid)), replanning_on=False,
                   checkpoint_enabled=False, delegate_after_s3=True)
    assert plan_changes(decision, view, mon).delegate_links == ((0, 1),)


@pytest.mark.parametrize("links", [[(0, 0)], [(0, 1, 2)], [("0", "1")], [(0, -1)], "0-1", [(True, 1)]])
def test_delegating_bad_links_is_a_clear_error(links):
    from titan_ext.runtime.comm.delegate.schedule import _links_arg

    with pytest.raises(ValueError, match="pairs of two different global ranks"):
        _links_arg(links)
    assert _links_arg([(0, 1), [1, 0], (2, 3)]) == {frozenset((0, 1)), frozenset((2, 3))}


@pytest.mark.parametrize("rounds, slow", [
    ([{(0, 1): 0.05}, {}], False),  # a spike in the first round alone: host noise, not a link
    ([{(0, 1): 0.05}, {(0, 1): 0.04}], True),  # slow in both rounds: the link's
])
def test_validation_calls_a_link_slow_only_when_both_rounds_find_it_slow(monkeypatch, rounds, slow):
    """``measure.validate`` times the rings again when a link looks slow and keeps each link's faster
    time: a link flagged by one noisy round would make the root cause ``dp_link`` and send Falcon
    down the link's ladder (S3) when the device is the fault. Healthy links take 1 ms here."""
    from titan_ext.runtime.falcon import measure

    grid = [[0, 2], [1, 3]]
    healthy = {(a, b): 0.001 for a, b in ((0, 1), (1, 0), (2, 3), (3, 2), (0, 2), (2, 0), (1, 3), (3, 1))}
    calls = iter(rounds)
    monkeypatch.setattr(measure, "_time_rings", lambda *a: {**healthy, **next(calls)})
    monkeypatch.setattr(measure, "gemm_probe", lambda **kw: {0: 0.01, 1: 0.01, 2: 0.01, 3: 0.04})
    mon = FalconMonitor(FalconConfig(), grid=grid)
    mon.suspicious = ["dp_stage0"]  # profiling flagged the DP column of stage 0: ring 0-1
    measure.validate(mon, grid=grid, emulation=SimpleNamespace(compute_factor=None), control=None, device=None)
    assert next(calls, None) is None  # both rounds ran
    assert ((0, 1) in mon.slow_links) == slow
    assert mon.slow_devices == [3]
    assert mon.root_cause == ("dp_link" if slow else "compute")
