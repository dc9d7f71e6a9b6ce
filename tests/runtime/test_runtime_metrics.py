"""runtime/measure/metrics.py: the published keys of ``last_metrics`` (moved from test_runtime_parts.py)."""

from __future__ import annotations

import math

import pytest

from titan_ext.runtime.measure.metrics import IterationMetrics


def test_metrics_dict_keeps_the_published_keys():
    m = IterationMetrics(3, 12.5, decision="keep", extra={"falcon/event": "none"})
    d = m.as_dict()
    for key in ("iteration", "iteration_time_ms", "bubble_rate", "timeline_span_ms", "link_delay_ms",
                "link_delay_estimate_ms", "compute_ms", "backward", "plan_version", "plan_hash", "warmup_counts",
                "slackness", "eq1_tolerance_ms", "replan_ms", "deployed", "plan_ms", "plan_cpu_ms", "swap_ms",
                "exchange_ms", "boundary_ms", "decision", "decision_reason", "recv_wait_ms", "inflight_cap"):
        assert key in d, key
    assert d["iteration"] == 3 and d["falcon/event"] == "none" and "extra" not in d


class _FreshPlanMetrics:
    """A boundary observer that recomputes, from the estimator and the deployed plan at that boundary, what
    ``_fill_plan_metrics`` publishes (which it rebuilds only when either changed)."""

    every_iteration = False

    def __init__(self):
        self.sched, self.mismatches, self.seen = None, [], set()

    def attach(self, context):
        pass

    def observe(self, boundary):
        from titan_ext.plan.warmup import slackness

        s, m = self.sched, boundary.metrics
        # built from the windows here and now, past the estimator's own per-state memo too
        est, est_full = s.estimator._profile("split"), s.estimator._profile("full")
        cost = s.estimator.action_cost_ms()
        fresh = {"eq1_tolerance_ms": s.parts.tolerances(est.with_action_cost(cost),
                                                        est_full.with_action_cost(cost, full_backward=True), s.deployed),
                 "compute_ms": {"F": list(est.f_ms), "I": list(est.b_ms), "W": list(est.w_ms), "B": list(est_full.b_ms)},
                 "link_delay_estimate_ms": dict(enumerate(est.delays_ms)),
                 "warmup_counts": list(s.deployed.warmup_counts),
                 "slackness": slackness(s.deployed.warmup_counts)}
        for key, want in fresh.items():
            if m[key] != want:
                self.mismatches.append((m["iteration"], key, m[key], want))
        self.seen.add(repr(fresh["eq1_tolerance_ms"]))
        return {}


def _fresh_metrics_worker(rank, world):
    import torch.nn.functional as Fn

    from titan_ext.runtime import PipeMorph, inject_link_delays
    from titan_ext.testing import train_steps

    checker = _FreshPlanMetrics()

    def make(stage):
        checker.sched = PipeMorph(stage, 8, loss_fn=Fn.mse_loss, observers=(checker,))
        return checker.sched

    with inject_link_delays("") as inj:
        train_steps(rank, world, make, 6, dim=16, batch=32)
        inj.update("0:25")  # the estimator changes, the plan follows: the published values must too
        sched, _, _ = train_steps(rank, world, lambda st: checker.sched, 10, dim=16, batch=32)
    return checker.mismatches, len(checker.seen), sched.plan_version


@pytest.mark.multiprocess
def test_published_plan_metrics_are_those_of_the_boundary_they_are_published_at():
    from titan_ext.testing import run_ranks

    for mismatches, distinct, versions in run_ranks(_fresh_metrics_worker, 2, backend="gloo"):
        assert mismatches == []
        assert distinct >= 2 and versions >= 2  # the estimator and the plan did change during the run
