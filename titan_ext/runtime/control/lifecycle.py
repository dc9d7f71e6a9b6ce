"""The plan life cycle of an adaptive schedule: candidate → validate → agree → swap (PipeMorph §6 ⑤, Fig.13).

A plan is deployed only at an iteration boundary, only once validated and lowered (``deploy.py``) and
only if every rank holds the same one (its hash agreed on the control plane).  Two paths:

* synchronous (:meth:`PlanLifecycle.deploy_now`: the initial plan, ``schedule.deploy()``): validate →
  lower → agree (one collective) → swap, now;
* background (:meth:`PlanLifecycle.start` / :meth:`PlanLifecycle.resolve`): plan → validate → lower in a
  thread while the next iteration runs; the candidate's hash travels in the next profile exchange and
  the swap follows it when every rank made the same plan and it still fits the memory cap;
* anytime polish (:meth:`PlanLifecycle.start_polish`, ``polish_s``): after a planner-made plan is deployed,
  a thread polishes it (``titan_ext.plan.polish.polish_plan``); the training thread never waits for it.
  A rank offers the polished plan's hash in the profile exchange only once its thread is done (else 0);
  the swap follows the check at which every rank offered the same non-zero hash (the polish is
  deterministic: the same plan on every rank), ranks not done yet are waited for at later checks, and a
  re-plan or any other deploy discards the pending polish (its result would be stale).

A plan that fails any step is never deployed; the deployed one stays and ``decision_log`` says why.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from titan_ext.plan.warmup import plan_slackness

from ..decide.planning import BackgroundPlanning, BackgroundPolish
from ..decide.policy import Decision
from ..measure.profiler import now
from .deploy import Candidate, DeployedPlan

__all__ = ["DecisionLog", "PlanLifecycle", "Resolution"]

logger = logging.getLogger(__name__)


class DecisionLog:
    """The schedule's ``decision_log``: entries stamped with the iteration they happened at."""

    def __init__(self, size: int, iteration: Callable[[], int]):
        self.entries: deque[dict] = deque(maxlen=size)
        self._iteration = iteration

    def __call__(self, **entry: Any) -> dict:
        entry = {"iteration": self._iteration(), **entry}
        self.entries.append(entry)
        return entry


@dataclass
class Resolution:
    """What :meth:`PlanLifecycle.resolve` did with the background job (if one ran)."""

    deployed: bool = False
    swap_ms: float = 0.0  # critical path of the resolution
    plan_ms: float = 0.0  # the job's wall time in the background
    plan_cpu_ms: float = float("nan")
    decision: Decision | None = None  # the decision that started the job (None: no job, or a polish)
    produced: bool = False  # the job produced a candidate (validated and lowered)
    candidate: Candidate | None = None  # the planning job's candidate (deployed, unchanged or rejected)
    polished: bool = False  # the swap (``deployed``) was a polished plan's


class PlanLifecycle:
    """Owns the deployed plan, its version, queued external plans and the background job.

    ``install(candidate)`` is the schedule's side of a swap (torch's action lists, stage map, its own
    per-plan counters); ``in_iteration()`` guards every swap to the boundary."""

    def __init__(self, name: str, control: Any, install: Callable[[Candidate], None],
                 in_iteration: Callable[[], bool], log: DecisionLog):
        self.name, self.control, self._install, self._in_iteration, self.log = name, control, install, in_iteration, log
        self.deployed: DeployedPlan | None = None
        self.version = 0
        self.planning = BackgroundPlanning()
        self.polish = BackgroundPolish()
        self._pending: list[tuple[Any, str]] = []  # (PlanResult or a raw mapping, reason)

    # -- swap and reject: the only two ends of every path --
    def swap(self, cand: Candidate) -> None:
        """Install a prepared plan (iteration boundary only): an O(1) pointer swap."""
        if self._in_iteration():
            raise RuntimeError(f"{self.name}: a plan may only be swapped at an iteration boundary")
        if cand.polish is None:
            self.discard_polish("another plan was deployed")
        self._install(cand)
        self.version += 1
        # a polished plan keeps the kind of the plan it polished (the regime the policy reasons about)
        self.deployed = DeployedPlan({r: list(a) for r, a in cand.actions.items()}, cand.counts, self.version,
                                     cand.hash, cand.reason, cand.kind, cand.backward, cand.inflight_limit)
        extra = {} if cand.polish is None else {
            "polished_kind": cand.kind, "before_ms": cand.polish.get("sim_before_ms"),
            "after_ms": cand.polish.get("sim_after_ms"), "polish_status": cand.polish.get("status")}
        self.log(decision="deploy", kind="polish" if cand.polish is not None else cand.kind, reason=cand.reason,
                 plan_version=self.version, plan_hash=hex(cand.hash), warmup_counts=cand.counts,
                 slackness=plan_slackness(cand.counts), backward=cand.backward, prepare_ms=cand.prepare_ms,
                 plan_ms=cand.plan_ms, plan_cpu_ms=cand.plan_cpu_ms, **extra)

    def reject(self, kind: str, reason: str) -> None:
        self.log(decision="reject", kind=kind, reason=reason, plan_version=self.version)
        logger.warning("%s: rejected plan: %s", self.name, reason)

    def _unchanged(self, cand: Candidate) -> bool:
        if self.deployed is None or cand.hash != self.deployed.hash:
            return False
        self.log(decision="unchanged", kind=cand.kind, reason=f"{cand.reason}: identical to the deployed plan",
                 plan_version=self.version)
        return True

    # -- synchronous path --
    def deploy_now(self, prepare: Callable[[], Candidate], kind: str, reason: str,
                   check_agreement: bool = True) -> bool:
        """validate/lower (``prepare()``) → agree (hash on the control plane) → swap; any failure keeps
        the deployed plan and logs why."""
        if self._in_iteration():
            raise RuntimeError(f"{self.name}: a plan may only be swapped at an iteration boundary")
        try:
            cand = prepare()
        except Exception as exc:  # noqa: BLE001 - validation or torch's lowering refused it
            self.reject(kind, f"{reason}: validation failed: {exc}")
            return False
        if self._unchanged(cand):
            return True
        if check_agreement:
            agreed, seen = self.control.agree(cand.hash)
            if not agreed:
                self.reject(kind, f"{reason}: ranks disagree on the plan (hashes {[hex(x) for x in seen]})")
                return False
        self.swap(cand)
        return True

    def queue(self, plan: Any, reason: str) -> None:
        """An external plan (``schedule.deploy()``'s ``PlanResult``) handed over during an iteration: deployed
        at the next boundary."""
        self._pending.append((plan, reason))

    def apply_pending(self, prepare: Callable[[Any, str], Callable[[], Candidate]]) -> None:
        pending, self._pending = self._pending, []
        for plan, reason in pending:
            self.deploy_now(prepare(plan, reason), "external", reason)

    # -- background path --
    def start(self, decision: Decision, job: Callable[[], Candidate], what: str) -> None:
        self.discard_polish("a re-plan started")
        self.planning.start(decision, job, what)

    def start_polish(self, job: Callable[[], tuple[Candidate | None, dict]], what: str) -> None:
        """The anytime polish of the deployed plan, in the background (module docstring)."""
        self.polish.start(job, what)

    def discard_polish(self, why: str) -> None:
        if self.polish.discard():
            self.log(decision="polish", reason=f"pending polish discarded: {why}", plan_version=self.version)

    def candidate_hash(self) -> int:
        """This rank's offer in the profile exchange: the planning job's hash (waits for the job: it is
        short), else the finished polish's (never waits: 0 while it runs), else 0."""
        if self.planning.running:
            return self.planning.candidate_hash()
        return self.polish.ready_hash()

    def resolve(self, candidate_hashes: list[int], over_cap: Callable[[Candidate], str]) -> Resolution:
        """After the exchange: swap the background plan if every rank made the same one and it still
        fits the memory cap (``over_cap`` says why not); else the pending polish's (:meth:`_resolve_polish`)."""
        if not self.planning.running:
            return self._resolve_polish(candidate_hashes, over_cap) if self.polish.pending else Resolution()
        t0 = now()
        cand, decision, error, bg_ms, cpu_ms = self.planning.take()
        out = Resolution(plan_ms=bg_ms, plan_cpu_ms=cpu_ms, decision=decision, produced=cand is not None,
                         candidate=cand)
        if cand is None:
            self.reject("", error)
        elif len(set(candidate_hashes)) != 1:
            self.reject(cand.kind, f"{cand.reason}: ranks disagree on the plan "
                        f"(hashes {sorted(hex(h) for h in set(candidate_hashes))})")
        elif cand.keep:  # a refine found nothing better; never swapped, even if the plan changed meanwhile
            self.log(decision="unchanged", kind=cand.kind, reason=cand.reason, plan_version=self.version)
        elif why := over_cap(cand):
            self.reject(cand.kind, f"{cand.reason}: {why}")
        elif not self._unchanged(cand):
            self.swap(cand)
            out.deployed = True
        out.swap_ms = 1e3 * (now() - t0)
        return out

    def _resolve_polish(self, candidate_hashes: list[int], over_cap: Callable[[Candidate], str]) -> Resolution:
        """The pending polish at a check.  Every rank sees the same gathered hashes, so every rank takes
        the same swap decision: all equal and non-zero → swap (each rank offered it, so each holds it);
        two different non-zero hashes → dropped everywhere.  Otherwise some rank is not done: a rank done
        without a plan (no improvement, skipped, failed) logs why once and drops its job; the others wait."""
        t0 = now()
        offered = {h for h in candidate_hashes if h}
        out = Resolution()
        if len(offered) > 1:
            what = self.polish.what
            self.polish.discard()
            self.reject("polish", f"{what}: ranks disagree on the polished plan "
                        f"(hashes {sorted(hex(h) for h in set(candidate_hashes))})")
        elif offered and all(candidate_hashes):
            cand, _, _, bg_ms, cpu_ms = self.polish.take()
            out.plan_ms, out.plan_cpu_ms = bg_ms, cpu_ms
            if why := over_cap(cand):
                self.reject("polish", f"{cand.reason}: {why}")
            elif not self._unchanged(cand):
                self.swap(cand)
                out.deployed = out.polished = True
        elif self.polish.finished and not self.polish.ready_hash():
            what = self.polish.what
            _, report, error, bg_ms, cpu_ms = self.polish.take()
            self.log(decision="polish", reason=error or f"{what}: {report.get('status', 'no plan')}",
                     plan_version=self.version, status=report.get("status", "failed"),
                     before_ms=report.get("sim_before_ms", report.get("before_ms")),
                     after_ms=report.get("sim_after_ms", report.get("after_ms")), plan_ms=bg_ms, plan_cpu_ms=cpu_ms)
            if error:
                logger.warning("%s: %s", self.name, error)
        out.swap_ms = 1e3 * (now() - t0)
        return out
