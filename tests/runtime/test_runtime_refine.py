"""A plan made before the estimator's window was full is planned once more when it fills
(``runtime/control/regime.py`` "Refine"), and swapped only when the model predicts it ``REFINE_MARGIN``
faster on the same estimate."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
import torch.nn.functional as Fn
from torch.distributed.pipelining import PipelineStage

from titan_ext.plan.builtin import plan_builtin
from titan_ext.plan.profile import PipelineProfile
from titan_ext.plan.schedules import plan_by_name
from titan_ext.runtime.control.regime import REFINE_MARGIN, _faster
from titan_ext.testing import run_ranks, seeded_batch, step_rank


def test_a_refined_plan_replaces_the_deployed_one_only_when_the_margin_faster():
    # F = I = W = 1 ms, S = 4, N = 8, no delay: 1F1B (full backward, B = I + W) runs (N + S − 1)(F + B) =
    # 33 ms and ZB-H1 (split) 3N + (S − 1)(F + I − W) = 27 ms (closed forms of the two schedules)
    profile = PipelineProfile.uniform(4, 8, 1.0, 1.0, 1.0)
    current = {"split": profile, "full": profile.fused()}
    one_f_one_b, zb_h1 = plan_builtin("1F1B", profile), plan_by_name(profile, "zb-h1")
    assert (one_f_one_b.predicted_makespan_ms, zb_h1.predicted_makespan_ms) == (33.0, 27.0)
    assert 27.0 < (1 - REFINE_MARGIN) * 33.0

    def deployed(plan, backward):
        return NS(actions=plan.ops, backward=backward)

    one_per_rank = {s: s for s in range(4)}
    assert _faster(zb_h1, deployed(one_f_one_b, "full"), current, one_per_rank)
    assert not _faster(one_f_one_b, deployed(zb_h1, "split"), current, one_per_rank)
    assert not _faster(zb_h1, deployed(zb_h1, "split"), current, one_per_rank)  # itself: not by the margin


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
def test_a_plan_from_a_partial_window_is_refined_once_when_it_fills():
    world = 4
    results = run_ranks(_refine_worker, world, 8, 12)
    r = results[0]
    assert all(x["decisions"] == r["decisions"] for x in results)  # every rank decided the same
    refines = [it for it, d in r["decisions"] if d == "refine"]
    assert len(refines) == 1, r["decisions"]
    # decided once the window holds `window` checks (the plans before were made from fewer)
    assert refines[0] >= r["checks"][r["window"] - 1], (refines, r["checks"])
    # resolved at a later check: the refined plan swapped in, or the deployed one kept as identical
    after = [e for e in r["log"] if e[0] > refines[0] and e[1] in ("deploy", "unchanged")]
    assert after and after[0][2].startswith("refine:"), r["log"]
