"""The anytime polish of an adaptive schedule (``polish_s``; PipeMorph §6 ⑤ made anytime).

After a planner-made plan is deployed, a background thread polishes it with CP-SAT and CrossPipe's
search (``titan_ext.plan.polish.polish_plan``) within ``polish_s`` seconds; the training thread never
waits for it, and the faster plan goes through the same lowering and agreement as any plan
(``lifecycle.py``: offered at a check once every rank is done, swapped at the same boundary everywhere).
Without OR-Tools the polish is off, said once when the schedule is built.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from torch.profiler import record_function

from titan_ext.plan.polish import NO_SOLVER, load_solver, polish_plan

from ..measure.profiler import now

__all__ = ["AnytimePolish"]

logger = logging.getLogger(__name__)


class AnytimePolish:
    """Starts the polish of each deployed planner-made plan.  ``prepare(ops, counts, kind, reason, limit)``
    is the schedule's deferred lowering (``AdaptiveSchedule._preparer``)."""

    def __init__(self, budget_s: float | None, name: str, num_stages: int, lifecycle: Any,
                 prepare: Callable[..., Callable[[], Any]], log: Any, warn: bool):
        self.budget_s, self.num_stages, self.lifecycle, self._prepare = budget_s, num_stages, lifecycle, prepare
        if budget_s is not None and not load_solver():  # imported now, not in the middle of training
            self.budget_s = None
            log(decision="polish", reason=f"polish_s={budget_s:g}: {NO_SOLVER}", status=NO_SOLVER)
            if warn:
                logger.warning("%s: polish_s=%g: %s", name, budget_s, NO_SOLVER)

    def start(self, res: Any, decision: Any) -> None:
        """The polish of the plan just resolved (``res``: a ``lifecycle.Resolution``), when it is the deployed
        one (swapped or unchanged), planner-made (with the profile it was planned for: ``PlanResult.profile``,
        head-room delays included), of the calibrated initial or an adaptive regime, not a backward probe,
        and no re-plan starts now (that would make the polish stale).  Every input is agreed, so every rank
        starts the same polish (deterministic: ``titan_ext.plan.polish``)."""
        cand, deployed = res.candidate, self.lifecycle.deployed
        if (self.budget_s is None or cand is None or decision.replans or cand.plan is None
                or cand.plan.profile is None or cand.kind not in ("initial", "adaptive") or cand.trigger == "probe"
                or deployed is None or deployed.hash != cand.hash):
            return
        plan, budget = cand.plan, self.budget_s
        what = f"polish of plan v{self.lifecycle.version} ({cand.kind}, {budget:g} s)"
        # the per-stage in-flight limit the plan was made under; a planner that records none (CrossPipe's
        # greedy holds its own per-rank limit) gets the plan's own peaks: the polish reorders, it never
        # trades memory for speed behind the user's back
        given = plan.inflight_limit
        limit = ([int(given)] * self.num_stages if isinstance(given, (int, float)) else list(given)
                 if given is not None else [max(1, plan.peak_inflight.get(s, 0)) for s in range(self.num_stages)])

        def job() -> tuple[Any, dict]:
            with record_function("titan_ext:plan"):  # on the polishing thread
                t0 = now()
                out = polish_plan(plan.profile, plan, budget_s=budget, memory_limit=limit)
                report = dict(out.info.get("polish") or {})
                if report.get("status") != "improved":
                    return None, report
                reason = (f"{what}: simulated {report['sim_before_ms']:.3f} -> {report['sim_after_ms']:.3f} ms "
                          f"(warm-up counts {out.warmup_counts})")
                # the regime's counts stay the deployed plan's: the policy judges the regime it planned (Eq.1 on
                # Alg.1/2's counts), and a faster order of the same regime must not look like a new one
                polished = self._prepare(out.ops, list(cand.counts), cand.kind, reason, limit)()
                polished.trigger, polished.polish, polished.plan_ms = "polish", report, 1e3 * (now() - t0)
                return polished, report

        self.lifecycle.start_polish(job, what)
