"""scripts/gpu_tier.py's read-outs and verdicts, in-process on CPU: the parts of the GPU tier that read
what the GPU run produced, so a lent GPU's minutes are not spent finding an error in them.

The plan read-out is the code path that failed on the H100 on 2026-11-28 ("too many values to unpack":
the deployed plan's torch ``_Action`` lists went where ``(stage, kind, mb)`` triples were expected):
:func:`test_plan_readout_takes_the_deployed_plan_ir` feeds it the IR a deployed plan holds."""

from __future__ import annotations

import math
import os
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_tier  # noqa: E402


def test_idle_fraction_is_the_share_of_the_span_no_action_covers():
    # busy 0-50, 40-100 (overlap merged), 150-200: 150 of a 200 ms span
    assert gpu_tier.idle_fraction([(0, 50), (40, 100), (150, 200)]) == pytest.approx(0.25)
    assert gpu_tier.idle_fraction([(150, 200), (0, 100)]) == pytest.approx(0.25)  # order does not matter
    assert gpu_tier.idle_fraction([(0, 100), (10, 20)]) == 0.0  # nested
    assert math.isnan(gpu_tier.idle_fraction([]))


def test_boundary_gaps_are_between_one_steps_last_end_and_the_next_steps_first_start():
    spans = [(2, 0, 50), (2, 60, 100), (3, 130, 180), (3, 110, 120), (4, 170, 220)]
    assert gpu_tier.boundary_gaps(spans) == [10, -10]  # 110 - 100; 170 - 180 (overlap: the device was busy)
    assert gpu_tier.boundary_gaps([(0, 0, 1)]) == []


def _step(k, exchange, **by_kind):
    return {"step": k, "exchange": exchange, "by_kind": by_kind,
            "sites": {f"{kind}@titan_ext/runtime/execute/device.py:1": n for kind, n in by_kind.items()}}


def test_the_budget_allows_no_sync_without_an_exchange_and_one_event_wait_with_one():
    ok = [_step(2, True, **{"Event.synchronize": 1}), _step(3, False)]
    assert gpu_tier.budget_violations(ok) == []
    bad = [_step(3, False, **{"Event.synchronize": 1}),                       # a steady step that waited
           _step(4, True, **{"Event.synchronize": 2}),                        # more than the exchange's one
           _step(5, True, **{"Event.synchronize": 1, "torch.cuda.synchronize": 1})]  # a device sync
    out = gpu_tier.budget_violations(bad)
    assert len(out) == 3
    assert out[0].startswith("step 3 (no exchange)") and "Event.synchronize@titan_ext/runtime/execute/device.py:1" in out[0]
    assert out[1].startswith("step 4 (exchange)") and out[2].startswith("step 5 (exchange)")


def test_plan_readout_takes_the_deployed_plan_ir():
    """``sched.deployed.actions`` is a ``DeployedPlan``'s: torch ``_Action`` lists by rank (4 fields each)."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType as C

    n = 4
    plan = {r: [_Action(r, C.FORWARD, m) for m in range(n)] + [_Action(r, C.BACKWARD_INPUT, m) for m in range(n)]
            + [_Action(r, C.BACKWARD_WEIGHT, m) for m in range(n)] for r in (0, 1)}
    prof = SimpleNamespace(actions=[SimpleNamespace(kind="F", stage=1, start=1.0, end=1.05),
                                    SimpleNamespace(kind="F", stage=1, start=2.0, end=2.07),
                                    SimpleNamespace(kind="F", stage=0, start=0.0, end=9.0),
                                    SimpleNamespace(kind="I", stage=1, start=3.0, end=3.1)])
    sched = SimpleNamespace(executor=SimpleNamespace(activation_bytes=1000), deployed=SimpleNamespace(actions=plan),
                            plan_version=2, last_profile=prof)
    out = gpu_tier.plan_readout(sched, [SimpleNamespace(stage_index=1)])
    # all 4 forwards of stage 1 are held until their W (the runtime's memory rule): 4 x 1000 bytes
    assert out["predicted_activation_bytes"] == 4 * 1000
    assert out["plan_version"] == 2
    assert out["booked_forward_ms"] == pytest.approx(60.0)  # median of stage 1's F: 50 and 70 ms


def _rank_cell(**kw):
    cell = {"schedule": "PipeMorph", "delay_ms": 0.0, "losses_equal_cpu": True, "params_equal_cpu": True,
            "params_moved": True, "params_equal_torch_1f1b": True, "params_max_abs_diff": 0.0,
            "predicted_activation_bytes": 4096, "action_ms_median": 50.2, "idle_fraction": 0.3,
            "steady_steps": [{**_step(2, True, **{"Event.synchronize": 1}), "syncs": 1, "host_ahead": False},
                             {**_step(3, False), "syncs": 0, "host_ahead": True}]}
    cell.update(kw)
    return cell


def test_a_cell_passes_when_every_rank_keeps_the_budget_and_the_host_ahead():
    row, why = gpu_tier.merge_cells(2, [_rank_cell(), _rank_cell()], cuda=True, action_ms=50.0)
    assert why == []
    assert row["host_syncs_per_step_max_per_rank"] == [1, 1]
    assert row["host_ahead_at_boundaries"] == "2/2"  # the steps without an exchange only
    assert row["steps_without_exchange"] == 1
    assert row["idle_fraction_per_rank"] == [0.3, 0.3]


def test_a_cell_fails_on_a_sync_a_host_behind_short_actions_or_no_plan_readout():
    behind = _rank_cell(steady_steps=[{**_step(3, False, **{"Event.synchronize": 1}), "syncs": 1, "host_ahead": False}])
    _, why = gpu_tier.merge_cells(2, [_rank_cell(), behind], cuda=True, action_ms=50.0)
    assert any(w.startswith("rank 1 host syncs: step 3 (no exchange)") for w in why), why
    assert any(w.startswith("host behind the device at 1 of 2") for w in why), why
    _, why = gpu_tier.merge_cells(2, [_rank_cell(action_ms_median=3.0), _rank_cell()], cuda=True, action_ms=50.0)
    assert why == ["actions shorter than 0.9 x 50 ms on ranks [0] (the device is not behind)"]
    _, why = gpu_tier.merge_cells(2, [_rank_cell(action_ms_median=3.0), _rank_cell()], cuda=False, action_ms=50.0)
    assert why == []  # on CPU the host runs the actions: nothing to be behind
    _, why = gpu_tier.merge_cells(2, [_rank_cell(predicted_activation_bytes=None), _rank_cell()], cuda=False,
                                  action_ms=1.0)
    assert why == ["no plan read-out (predicted activation bytes)"]


def test_a_cell_that_raised_reports_its_error_first():
    row, why = gpu_tier.merge_cells(2, [{"schedule": "CrossPipe", "delay_ms": 60.0, "error": "ValueError: x"},
                                        _rank_cell(schedule="CrossPipe", delay_ms=60.0)], cuda=True, action_ms=50.0)
    assert why == ["ValueError: x"]
    assert row["losses_equal_cpu"] is False
