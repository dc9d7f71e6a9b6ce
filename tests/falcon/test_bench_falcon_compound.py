"""Falcon §7.3's compound sequence (Fig. 17) as ``scripts/bench_falcon.py --compound`` runs it in the
TorchTitan job: its result from the job's rows (phases, mitigations, the paper's order, the plot), and
the monitor's rule that makes the order possible when S3 ends the first event (a relief) before the
device slows: the link S3 moved onto a pipeline hop stays handled in the next event, so the slow
device is the new root cause (S2), not the still-slow link. Fast: no processes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from titan_ext.runtime.falcon import FalconConfig, FalconMonitor, IterationObservation, StrategyCosts

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_falcon", ROOT / "scripts" / "bench_falcon.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(times: dict[int, float], restart_at: int) -> list[dict]:
    rows = [{"step": k, "falcon/iteration_time_s": v, "falcon/grid": "[]"} for k, v in times.items()]
    # the restarted job writes its steps twice (FalconJob's row and S4Resume's): the later one counts
    rows += [{"step": k, "falcon/iteration_time_s": v, "falcon/after_s4_from_step": restart_at - 1}
             for k, v in times.items() if k >= restart_at]
    return rows


def _decision(it, strategy, applied=True, cause="dp_link"):
    return {"kind": "decision", "iteration": it, "strategy": strategy, "name": strategy, "applied": applied,
            "impact_s": 1.0, "estimated_cost_s": 0.5, "suspected": {"root_cause": cause, "component": "x"}}


def test_compound_result_phases_order_and_plot(tmp_path):
    bench = _bench()
    healthy, link, after_s3, device, after_s2, after_s4 = 1.0, 2.0, 1.05, 5.0, 2.4, 1.1
    times = {k: healthy for k in range(1, 8)} | {k: link for k in range(8, 13)} | \
        {k: after_s3 for k in range(13, 28)} | {k: device for k in range(28, 31)} | \
        {k: after_s2 for k in range(31, 45)} | {k: after_s4 for k in range(45, 60)}
    times[1] = 9.0  # the first step (start-up) is not healthy's
    events = [_decision(12, "S1"), _decision(12, "S3"), _decision(30, "S3", applied=False, cause="compute"),
              _decision(30, "S2", cause="compute"), _decision(44, "S4", cause="compute"),
              {"kind": "restart", "iteration": 45, "strategy": "S4", "num_dp": 2, "world_size": 4, "mode": "replace"}]
    res = bench.compound_result(_rows(times, 45), events, link_from=8, device_from=28)
    assert res["healthy_ms"] == pytest.approx(1e3 * healthy)
    assert res["mitigations"] == [{"step": 12, "strategy": "S3"}, {"step": 30, "strategy": "S2"},
                                  {"step": 44, "strategy": "S4"}]
    assert [d["strategy"] for d in res["decisions"]] == ["S1", "S3", "S3", "S2", "S4"]  # every decision
    assert res["after_s3_ms"] == pytest.approx(1e3 * after_s3) and res["after_s2_ms"] == pytest.approx(1e3 * after_s2)
    assert res["after_s4_ms"] == pytest.approx(1e3 * after_s4)
    assert res["ratios"]["after_s4_over_healthy"] == pytest.approx(1.1)
    assert res["paper_order"] and res["within_1_15x"]
    assert len(res["iteration_ms"]) == 59  # one time a step, the restarted job's included
    # the order broken (S4 before S2) or the restart shrinking DP: not the paper's sequence
    swapped = [e if e.get("strategy") != "S2" else {**e, "iteration": 46} for e in events]
    assert not bench.compound_result(_rows(times, 45), swapped, 8, 28)["paper_order"]
    shrunk = events[:-1] + [{**events[-1], "num_dp": 1, "world_size": 2}]
    assert not bench.compound_result(_rows(times, 45), shrunk, 8, 28)["paper_order"]
    slow = bench.compound_result(_rows({**times, **{k: 1.3 for k in range(45, 60)}}, 45), events, 8, 28)
    assert not slow["within_1_15x"]
    png = tmp_path / "compound.png"
    pytest.importorskip("matplotlib")
    bench.plot_compound(res, str(png))
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(res)  # the JSON the bench writes


# --------------------------------------------------------------------------- the monitor's rule
F, C, FACTOR = 0.2, 0.1, 8.0
COSTS = StrategyCosts(microbatch_redistribution=0.5, topology_adjustment=2.0, checkpoint_restart=40.0)
LINK_FROM, DEVICE_FROM, STEPS = 60, 150, 320


def _host(it: int, grid, split):
    """DP 2 x PP 2 on devices of their own: step F + max(m_i t_i); the slow link 0-1 costs +1 s inside
    a DP group and nothing once S3 moved it onto a pipeline hop (so the first event ends: a relief);
    validation still finds it slow."""
    slow_dev = it >= DEVICE_FROM
    t = [C * (FACTOR if slow_dev and 3 in row else 1.0) for row in grid]
    step = F + max(m * x for m, x in zip(split, t))
    on_pp = any(abs(row.index(0) - row.index(1)) == 1 for row in grid if 0 in row and 1 in row)
    if it >= LINK_FROM and not on_pp:
        step += 1.0
    links = {(a, b): (0.05 if {a, b} == {0, 1} and it >= LINK_FROM else 0.001)
             for a, b in [(0, 1), (1, 0), (2, 3), (3, 2), (0, 2), (2, 0), (1, 3), (3, 1)]}
    gemm = {r: 0.01 * (FACTOR if r == 3 and slow_dev else 1.0) for r in range(4)}
    return step, t, links, gemm


def _run(forget_moved_links: bool):
    from _falcon_model import apply_on_model

    from titan_ext.runtime.falcon.apply import JobView, plan_changes

    grid, split, even = [[0, 2], [1, 3]], [3, 3], [3, 3]
    mon = FalconMonitor(FalconConfig(costs=COSTS, num_microbatches=6, slow_device_ratio=1.5),
                        grid=grid, pp_groups={"pp0_link0": 0, "pp1_link0": 0}, dp_groups=["dp_stage0", "dp_stage1"])
    if forget_moved_links:  # the rule off: every new event starts with nothing handled
        mon._handled_across_events = lambda: set()
    rng = np.random.default_rng(35)
    applied, causes, events = [], [], []
    for it in range(STEPS):
        step, t, links, gemm = _host(it, grid, split)
        decision = mon.observe(IterationObservation(step * (1 + 0.01 * rng.standard_normal()),
                                                    replica_microbatch_s=t, split=split))
        if decision.validate:
            decision = decision.with_metrics(mon.report_validation(links, gemm))
        if "falcon/event" in decision:
            events.append((it, decision["falcon/event"]))
        if "falcon/root_cause" in decision:
            causes.append((it, decision["falcon/root_cause"]))
        view = JobView(step=it, split=tuple(split), even_split=tuple(even), grid=tuple(map(tuple, grid)),
                       replanning_on=True, checkpoint_enabled=True, spares=(4,))
        changes = plan_changes(decision, view, mon)
        split, grid, names = apply_on_model(changes, split, grid, even, mon)
        applied += [(it, name) for name in names if name not in ("ignore", "pipemorph_replan")]
        if changes.s4_plan is not None:
            return applied, causes, events, changes.s4_plan
    return applied, causes, events, None


def test_after_s3_and_a_relief_the_slow_device_is_the_next_root_cause_not_the_moved_link():
    """Falcon §7.3's order when S3 removes the link's cost entirely (the event ends, a relief): the
    device that slows later is a new event whose root cause is ``compute`` -> S2, then S4 onto the
    spare (DP kept). Without the rule the new event starts with the moved link unhandled, its cause
    ``pp_link``, and S2 never comes."""
    from titan_ext.runtime.falcon.restart import ReplacePlan

    applied, causes, events, plan = _run(forget_moved_links=False)
    assert [n for _, n in applied] == ["topology_adjustment", "microbatch_redistribution", "checkpoint_restart"]
    (i3, _), (i2, _), (i4, _) = applied
    assert LINK_FROM < i3 < DEVICE_FROM < i2 < i4
    assert any(k == "relief" and i3 < i < DEVICE_FROM for i, k in events)  # the first event ended
    assert [c for _, c in causes] == ["dp_link", "compute"]
    assert isinstance(plan, ReplacePlan) and plan.excluded == [3] and plan.num_dp == 2
    assert plan.devices == [0, 2, 1, 4]  # the S3 grid [[0, 1], [2, 3]] kept, device 3 -> spare 4

    applied, causes, _, _ = _run(forget_moved_links=True)
    assert "microbatch_redistribution" not in [n for _, n in applied]
    assert [c for _, c in causes][:2] == ["dp_link", "pp_link"]
