"""The Fig. 19 bench's arithmetic (scripts/bench_falcon.py): the head-of-line calibration to PipeMorph
Fig. 6's 1.9× (§3.2) and the per-fault-size summary over invocations. No processes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_falcon", ROOT / "scripts" / "bench_falcon.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_target_is_fig6s_measured_ratio(bench):
    # PipeMorph §3.2: "increases the iteration time from 710 ms to 1350 ms—a 1.9x slowdown"
    assert bench.HOL_TARGET == pytest.approx(1.901, abs=1e-3)
    assert bench.FIG19_PAPER["s3_over_baseline"] == pytest.approx(0.278, abs=1e-3)  # 3.6x improvement


def test_pick_hold_interpolates_between_the_points_around_the_target(bench):
    # ratio 1.2 at hold 0, 2.6 at hold 1: 1.9 lies half way
    got = bench.pick_hold([(1.0, 2.6), (0.0, 1.2)], 1.9)
    assert got["hold"] == pytest.approx(0.5) and not got["saturated"]
    # a third point at 0.5 reading 2.2: the target now lies between 0 (1.2) and 0.5 (2.2)
    got = bench.pick_hold([(0.0, 1.2), (1.0, 2.6), (0.5, 2.2)], 1.9)
    assert got["hold"] == pytest.approx(0.5 * (1.9 - 1.2) / (2.2 - 1.2))
    assert got["bracket"] == [(0.0, 1.2), (0.5, 2.2)]


def test_pick_hold_treats_a_noisy_dip_as_flat(bench):
    # hold 0.5 measured below hold 0 (host noise): the running maximum makes it 1.5, so the target
    # 1.8 lies between 0.5 (1.5) and 1 (2.1) rather than being read off the dip
    got = bench.pick_hold([(0.0, 1.5), (0.5, 1.3), (1.0, 2.1)], 1.8)
    assert got["hold"] == pytest.approx(0.5 + 0.5 * (1.8 - 1.5) / (2.1 - 1.5))


def test_pick_hold_saturates_when_the_maximal_hold_falls_short(bench):
    got = bench.pick_hold([(1.0, 1.5)], 1.9)
    assert got == {"hold": 1.0, "predicted_ratio": 1.5, "saturated": True, "bracket": [(1.0, 1.5), (1.0, 1.5)]}
    # below the weakest point: no blocking needed beyond it
    got = bench.pick_hold([(0.0, 2.0), (1.0, 3.0)], 1.9)
    assert got["hold"] == 0.0 and not got["saturated"]
    with pytest.raises(ValueError):
        bench.pick_hold([], 1.9)
    with pytest.raises(ValueError):
        bench.pick_hold([(1.5, 2.0)], 1.9)


def test_hol_ratio_is_the_jobs_faulty_median_over_its_healthy_median(bench):
    series = {0: 9000.0, 1: 5000.0, 2: 1000.0, 3: 1100.0, 4: 900.0, 5: 1800.0, 6: 2000.0, 7: 2200.0, 8: 1900.0}
    got = bench.hol_ratio(series, fault_from=5)
    # healthy: steps 2..4 (start-up steps 0, 1 skipped) -> 1000; faulty: steps 6..8 (step 5 left out) -> 2000
    assert got["healthy_ms"] == 1000.0 and got["faulty_ms"] == 2000.0 and got["ratio"] == 2.0
    assert (got["healthy_steps"], got["faulty_steps"]) == (3, 3)
    with pytest.raises(ValueError):
        bench.hol_ratio({0: 1.0, 1: 1.0}, fault_from=2)


def _run(bench, ms, healthy, baseline, s3, pm, s3_steps=None):
    run = {"fault_ms": ms, "healthy_ms": healthy, "baseline_ms": baseline, "s3_ms": s3, "s3_pipemorph_ms": pm,
           "s3_steps": s3_steps or {"s3": 8, "s3_pipemorph": 8}}
    run["ratios"] = bench.fig19_ratios(run)
    return run


def test_summary_gives_median_and_spread_per_fault_size(bench):
    runs = [_run(bench, 30, 2000, 8000, 3000, 2000), _run(bench, 30, 2500, 7500, 2500, 2500),
            _run(bench, 30, 2200, 6600, 3300, 2200), _run(bench, 10, 2000, 4000, 2500, 2000)]
    summary = bench.summarize_fig19(runs)
    assert set(summary) == {"10", "30"} and summary["30"]["invocations"] == 3
    b = summary["30"]["ratios"]["baseline_over_healthy"]
    assert (b["median"], b["min"], b["max"]) == (3.0, 3.0, 4.0)  # 4.0, 3.0, 3.0
    s = summary["30"]["ratios"]["s3_speedup_over_baseline"]
    assert s["median"] == pytest.approx(2.6666, abs=1e-3) and s["max"] == 3.0  # 8/3, 3, 2
    assert summary["30"]["healthy_ms"]["median"] == 2200
    assert summary["10"]["ratios"]["s3_pipemorph_over_s3"]["values"] == [0.8]


def test_an_invocation_whose_s3_arm_never_applied_s3_is_left_out(bench):
    runs = [_run(bench, 30, 2000, 8000, 3000, 2000),
            _run(bench, 30, 2000, 8000, 8000, 2000, s3_steps={"s3": None, "s3_pipemorph": 8})]
    row = bench.summarize_fig19(runs)["30"]
    assert row["invocations"] == 1 and row["ratios"]["s3_over_baseline"]["values"] == [0.375]
    assert [e["s3_steps"] for e in row["excluded"]] == [{"s3": None, "s3_pipemorph": 8}]
    only_bad = bench.summarize_fig19(runs[1:])["30"]
    assert only_bad["invocations"] == 0 and "ratios" not in only_bad


def test_pre_fault_noise_is_the_spread_of_the_arms_identical_healthy_steps(bench):
    per_step = {"healthy": {"1": 9e3, "2": 100.0, "3": 120.0, "4": 110.0, "5": 500.0},
                "baseline": {"1": 9e3, "2": 150.0, "3": 150.0, "4": 160.0, "5": 900.0}}
    got = bench.pre_fault_ms(per_step, fault_from=5)
    assert got["median"] == {"healthy": 110.0, "baseline": 150.0}
    assert got["max_over_min"] == pytest.approx(150 / 110)
