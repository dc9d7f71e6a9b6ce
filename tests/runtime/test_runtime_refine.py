"""A planner-made plan is planned once more when the estimator's window holds only checks measured under it
(``runtime/control/regime.py`` "Refine"), and swapped only when the model predicts the new plan
``REFINE_MARGIN`` faster on that estimate."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as Fn
from torch.distributed.pipelining import PipelineStage

from titan_ext.plan.builtin import plan_builtin
from titan_ext.plan.profile import PipelineProfile
from titan_ext.plan.schedules import plan_by_name
from titan_ext.runtime.control.regime import REFINE_MARGIN, _makespan, _pays
from titan_ext.testing import run_ranks, seeded_batch, step_rank


def test_a_refined_plan_replaces_the_deployed_one_only_when_the_margin_faster():
    # F = I = W = 1 ms, S = 4, N = 8, no delay: 1F1B (full backward, B = I + W) runs (N + S − 1)(F + B) =
    # 33 ms and ZB-H1 (split) 3N + (S − 1)(F + I − W) = 27 ms (closed forms of the two schedules)
    profile = PipelineProfile.uniform(4, 8, 1.0, 1.0, 1.0)
    current = {"split": profile, "full": profile.fused()}
    one_f_one_b, zb_h1 = plan_builtin("1F1B", profile), plan_by_name(profile, "zb-h1")
    assert (one_f_one_b.predicted_makespan_ms, zb_h1.predicted_makespan_ms) == (33.0, 27.0)
    assert 27.0 < (1 - REFINE_MARGIN) * 33.0

    one_per_rank = {s: s for s in range(4)}  # each plan simulated under the estimate of its own variant
    one_f_one_b_ms = _makespan(one_f_one_b.ops, "full", current, one_per_rank)
    zb_h1_ms = _makespan(zb_h1.ops, "split", current, one_per_rank)
    assert (one_f_one_b_ms, zb_h1_ms) == (33.0, 27.0)
    assert _pays(zb_h1_ms, one_f_one_b_ms)
    assert not _pays(one_f_one_b_ms, zb_h1_ms)
    assert not _pays(zb_h1_ms, zb_h1_ms)  # itself: not by the margin


def _refine_worker(rank, world, n_mb, steps):
    from titan_ext.runtime import PipeMorph, inject_link_delays
    from titan_ext.testing import SleepComputeStage

    inject_link_delays(f"{world - 2}:40")
    mod = SleepComputeStage(8, 2.0, 2.0, 2.0, seed=rank)
    sched = PipeMorph(PipelineStage(mod, rank, world, torch.device("cpu")), n_mb, loss_fn=Fn.mse_loss)
    for k in range(steps):
        x, y = seeded_batch(500 + k, 8, 8, torch.float32)
        step_rank(sched, rank, world, x, y)
    return {"log": [(e["iteration"], e["decision"], e["reason"][:40]) for e in sched.decision_log],
            "decisions": [(m["iteration"], m["decision"]) for m in sched.metrics_history],
            "checks": [m["iteration"] for m in sched.metrics_history if m["check"] in ("exchange", "decided")],
            "window": sched.estimator.window.size}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_planner_made_plan_is_refined_once_after_a_window_of_its_own_checks():
    world = 4
    results = run_ranks(_refine_worker, world, 8, 14)
    r = results[0]
    assert all(x["decisions"] == r["decisions"] for x in results)  # every rank decided the same
    refines = [it for it, d in r["decisions"] if d == "refine"]
    assert refines, r["decisions"]
    deploys = [e[0] for e in r["log"] if e[1] == "deploy"]
    for at in refines:
        # decided once `window` checks were measured under the plan deployed last before it
        installed = max(it for it in deploys if it < at)
        assert sum(installed < c <= at for c in r["checks"]) >= r["window"], (at, installed, r["checks"])
        # resolved at the next check (if the run had one): the refined plan swapped in, or the deployed one kept
        if any(c > at for c in r["checks"]):
            after = [e for e in r["log"] if e[0] > at and e[1] in ("deploy", "unchanged")]
            assert after and after[0][2].startswith("refine:"), r["log"]
    # a refined plan is not refined again: one refine per plan a policy decision deployed
    made = [e for e in r["log"] if e[1] == "deploy" and not e[2].startswith(("refine:", "initial plan (Alg.1)"))]
    assert len(refines) <= len(made), (refines, r["log"])
