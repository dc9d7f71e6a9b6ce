"""The policy's side of a check (PipeMorph §6 ③): the deployed plan's regime and the decision on it.

A *regime* is a plan the policy chose (the initial plan, its calibration, an adapt or shrink); within
one the backward variant may be probed and selected (``backward.py``) and a polish may reorder it
(``anytime.py``) without the policy seeing a new regime.  :class:`Regime` keeps what the decision reads
across checks — Alg.1's counts for the current x_max, whether the initial plan was calibrated with
measured times, iterations since the last deploy, a running backward probe, the delays the deployed plan
absorbed, the checks since its plan was installed — and :meth:`Regime.decide` runs the policy on the agreed
estimates (identical inputs on every rank, so every rank reaches the same decision).

**Refine.** A plan is made from the times measured under the plan before it (the calibration from the first
iteration's, an adaptation from the old plan's), and a rank's action times and gaps depend on the plan it
runs (its contention, its gaps) by a few per cent — enough to change which plan is fastest at a memory limit
(plans 4–5 % above the CP-SAT optimum on the frontier benchmark, where the same planner on the settled
estimate came within 0–1.2 %).  So once the estimator's window holds only checks measured under a
planner-made regime's own plan, that regime is planned once more (decision ``refine``), and the new plan
replaces it only if the model, on that estimate, predicts it ``REFINE_MARGIN`` faster; otherwise the
deployed plan stays (logged ``unchanged``; never swapped back, should a user's plan have been deployed
meanwhile).  A refined plan is not refined again: it is *verified* (below).

**Realised?** The refine first predicts the deployed plan under that estimate, and plans both backward
variants on it.  Where the median span of the ``window`` checks it ran exceeds its prediction by more than
``MODEL_TOLERANCE``, the model does not describe this hardware well enough to rank the two backward variants
(ranks sharing host cores: a split plan's extra actions slow the other ranks' host work, which the model, one
device per rank, cannot see).  Under ``backward="auto"`` the refine's job then makes, instead of a refined
plan, the probe of the other variant: the planner's plan of it at the same memory (at 1F1B's memory with no
delay, the full variant's is 1F1B's own plan: ``decide/planning.HOLD_MARGIN``), or, where only one variant
was planned, the other variant with the same warm-up counts (``backward.py``'s probe and select); the measured
verdict chooses the variant of every plan made for similar link delays while it holds.  The same probe
is made where the plan is realised but the other variant's plan is predicted within ``MODEL_TOLERANCE`` of
it (either way): the model, itself that far off on this hardware, cannot rank them.  Found at 4 ranks on 2
cores with no delay: the full plan ran 146.7 ms (within 5 % of its prediction), the split plan predicted
within 1 % of it ran 136 ms in other invocations, where the realisation check happened to fail.

**Verified.** The refined plan is a new plan, which the refine's realisation check never saw run.  So once
the window holds ``window`` checks measured under it, the same check runs on it alone (decision ``verify``:
nothing is planned): beyond ``MODEL_TOLERANCE`` above its prediction, its variant is probed as above;
within, it stays (logged ``unchanged``).  Found at 16 ranks on 2 cores at 1F1B's memory with no delay: a
refined split plan ran 14.7 % above its prediction for good, 0.97× torch's 1F1B, where the full variant (1F1B's
own plan) runs at par.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any, Callable

from titan_ext.plan import initial_warmup_counts, simulate

from torch.profiler import record_function

from ..decide.backward import VARIANTS, BackwardChoice, other_variant
from ..decide.policy import Decision
from .deploy import Candidate, backward_of
from ..measure.profiler import link_delay_estimates, now, timeline_bubble_rate

__all__ = ["Regime"]

#: decisions whose new plan keeps the memory regime of Alg.1 ("initial") or forces a plan
_KIND_OF_DECISION = {"calibrate": "initial", "force": "forced"}
#: a refined plan replaces the deployed one only when predicted this much faster (relative; measured times
#: jitter by about as much from one window to the next, and every swap is a new plan version)
REFINE_MARGIN = 0.02
#: a deployed plan whose measured span exceeds its prediction by more than this at its refine has its
#: backward variant measured (module docstring; the frontier benchmark's plans ran 0.4–3.1 % above theirs
#: on a quiet 4-rank host, 8–13 % at 8 ranks on 2 cores)
MODEL_TOLERANCE = 0.05


class Regime:
    """Regime state and the decision at a check, for one schedule (``parts``: its policy, estimator and
    memory budget; ``config``: its settings)."""

    def __init__(self, parts: Any, config: Any, num_stages: int, log: Any):
        self.parts, self.num_stages, self.slack_floor, self.log = parts, num_stages, config.slack_floor, log
        self.initial_counts = initial_warmup_counts(num_stages, parts.memory.x_max)
        self.since_deploy, self.calibrated, self.probe_running = 0, False, False
        self.planned_for_ms: list[float] | None = None  # the deployed plan's absorbed delays
        #: what is due for the deployed regime's plan once its window is measured ("refine", "verify" or None);
        #: checks absorbed since it was installed
        self.refine_due: str | None = None
        self.checks_since_install = 0
        #: the deployed plan's warm-up counts and in-flight limit when a refine may probe (a select back to it)
        self.probe_base: tuple[list[int], list[int] | None] = ([], None)
        settings = config.policy_settings
        self.backward = BackwardChoice(config.backward, parts.choose_backward, parts.estimator.window.size,
                                       config.backward_margin, log, settings.rel_margin, settings.abs_margin_ms)

    def absorb(self, ranks: list, rank: int, deployed_backward: str) -> tuple[list[dict], float, float]:
        """The gathered profiles → the estimator's windows, activation bytes and the memory cap, the
        backward chooser's spans; returns (per-link delay readings, bubble rate, timeline span)."""
        hashes = {r.plan_hash for r in ranks}
        if len(hashes) != 1:
            self.log(decision="error", reason=f"ranks ran different plans this iteration: {sorted(hashes)}")
        links = link_delay_estimates(ranks)
        bubble, span_ms = timeline_bubble_rate(ranks)
        if all(not math.isnan(r.activation_bytes) for r in ranks):
            self.parts.memory.absorb([r.memory_budget_bytes for r in ranks], [r.activation_bytes for r in ranks], rank)
        self.parts.estimator.push(ranks, [lk["c_ms"] for lk in links])
        self.checks_since_install += 1
        if math.isfinite(span_ms) and deployed_backward in VARIANTS:
            self.backward.chooser.record(deployed_backward, span_ms)
        return links, bubble, span_ms

    def installed(self, cand: Any) -> None:
        """A new regime's plan (not a polish of the running one) was swapped in: its counters."""
        plan = cand.plan
        # a backward probe / select runs the running plan's counts in the other backward variant (an explicit
        # plan, no profile of its own): made for the delays the running plan was made for, the same regime
        same_regime = cand.trigger in ("probe", "select")
        if plan is not None and plan.profile is not None:
            self.planned_for_ms = plan.profile.delays_ms
        elif not same_regime:
            self.planned_for_ms = None
        note = getattr(self.parts.policy, "note_deployed", None)  # optional hook of a Policy
        if note is not None:
            note(self.planned_for_ms)
        self.since_deploy = 0
        self.probe_running = cand.trigger == "probe"
        if not same_regime:  # a new regime: compare the backward variants afresh
            self.backward.chooser.new_regime()
            due = None if cand.plan is None else "verify" if cand.trigger == "refine" else "refine"
            self.refine_due, self.checks_since_install = due, 0

    def resolved(self, res: Any) -> None:
        """The background job of the last decision was resolved (``lifecycle.Resolution``)."""
        if res.produced and res.decision.action == "calibrate":
            self.calibrated = True
        cand = res.candidate
        if res.deployed and res.decision is not None and res.decision.action in ("refine", "verify") \
                and cand.trigger == "probe":
            # the refine found the deployed plan not realised (module docstring): its job made the probe
            counts, limit = self.probe_base
            self.backward.chooser.start_probe(other_variant(cand.backward), counts, limit, f"; {cand.reason}")

    def decide(self, deployed: Any, adaptive: bool, delegating: bool, iteration: int) -> Decision:
        """The policy's decision on the window estimates, the initial plan's calibration once the times
        are measured, then the backward chooser's say (probe / select)."""
        decision = self._decision(deployed, adaptive, delegating, iteration)
        if not self.backward.chooser.probing:  # the verdict kept the probed variant: no swap marks the end
            self.probe_running = False
        return decision

    def _decision(self, deployed: Any, adaptive: bool, delegating: bool, iteration: int) -> Decision:
        parts = self.parts
        est = parts.memory.capped(parts.estimator.planning_profile(deployed.backward), delegating)
        counts = deployed.warmup_counts
        if not adaptive and not parts.policy.forces:
            decision = Decision("keep", "adaptation disabled")
        else:
            decision = parts.policy.decide(est, counts, self.initial_counts, self.since_deploy,
                                           slack_floor=self.slack_floor)
        if decision.action in ("keep", "hold") and not self.calibrated and adaptive:
            if parts.memory.recalibrate():
                self.initial_counts = initial_warmup_counts(self.num_stages, parts.memory.x_max)
            if deployed.kind == "initial":
                return Decision("calibrate", f"initial plan regenerated with measured times "
                                f"(Alg.1, x_max={parts.memory.x_max})", mode="initial")
            self.calibrated = True
        chooser = self.backward.chooser
        verdict = chooser.reusable(est.delays_ms, iteration) if self.backward.by_model else None
        if decision.replans and decision.backward is None and verdict is not None:
            decision = dataclasses.replace(decision, backward=verdict)  # the measured verdict holds
        if adaptive and self.calibrated and deployed.kind in ("initial", "adaptive"):
            mode = "initial" if deployed.kind == "initial" else "adaptive"
            window = self.parts.estimator.window.size
            quiet = decision.action in ("keep", "hold") and chooser.decided
            if quiet and self.refine_due and self.checks_since_install >= window:
                due, self.refine_due = self.refine_due, None
                if due == "refine":
                    return Decision("refine", f"planned again on {window} checks measured under the plan", mode=mode,
                                    backward=verdict)
                if self.backward.by_model and verdict is None:  # a measured verdict chose the variant: no probe
                    return Decision("verify", f"the refined plan measured on {window} checks under it", mode=mode)
            return chooser.step(decision, deployed.backward, counts, mode, est.delays_ms, iteration,
                                deployed.inflight_limit)
        return decision

    def settled(self, decision: Decision, planning: bool, adaptive: bool) -> bool:
        """Nothing is changing after ``decision`` (the check period may grow: ``cadence.py``)."""
        return (decision.action in ("keep", "hold") and not planning and not self.probe_running
                and (self.calibrated or not adaptive))

    def replan(self, decision: Decision, deployed: Any, plan: Callable, prepare: Callable) -> tuple[Callable, str]:
        """The background job of a re-plan and its reason: plan (``plan(profile, decision)``) → validate →
        lower (``prepare(ops, counts, kind, reason, limit)()``).  The variants to plan and their profiles
        are read here, on the training thread (``backward.py``)."""
        kind = _KIND_OF_DECISION.get(decision.action, decision.mode or "adaptive")
        reason = f"{decision.action}: {decision.reason}"
        estimator, choice = self.parts.estimator, self.backward
        running = deployed.backward if deployed else None
        refine, verify_only = decision.action in ("refine", "verify"), decision.action == "verify"
        variants = [] if verify_only else choice.variants(decision, deployed, estimator.window.median("B", self.num_stages))
        work = [(estimator.planning_profile(v), dataclasses.replace(decision, backward=v)) for v in variants]
        current = {v: estimator.planning_profile(v) for v in VARIANTS} if refine else {}
        stage_to_rank = dict(enumerate(self.parts.layout.stage_to_rank))
        spans, window = choice.chooser.spans.get(running, []), estimator.window.size
        # realised? (module docstring) — the measured median span of the deployed plan, when auto may measure
        verify = refine and choice.by_model and decision.backward is None and len(spans) >= window
        measured_ms = statistics.median(spans[-window:]) if verify else math.inf
        if verify:  # a select back to the deployed variant runs the deployed plan's counts and memory
            self.probe_base = (list(deployed.warmup_counts), deployed.inflight_limit)
            same_counts = dataclasses.replace(decision, action="probe", backward=other_variant(running),
                                              warmup_counts=list(deployed.warmup_counts),
                                              inflight_limit=deployed.inflight_limit)

        def stay(note: str, plan_ms: float) -> Candidate:  # the deployed plan stays (lifecycle: "unchanged")
            return Candidate(deployed.actions, {}, {}, deployed.warmup_counts, deployed.hash, kind, f"{reason} ({note})",
                             deployed.backward, trigger=decision.action, plan_ms=plan_ms, keep=True)

        def job() -> Any:
            with record_function("titan_ext:plan"):  # on the planning thread
                t0 = now()
                plans = {d.backward: plan(estimate, d) for estimate, d in work}
                if refine:
                    deployed_ms = _makespan(deployed.actions, running, current, stage_to_rank)
                    why = None
                    if verify and measured_ms > (1.0 + MODEL_TOLERANCE) * deployed_ms:  # not realised: measure
                        why = (f"measured {measured_ms:.1f} ms, predicted {deployed_ms:.1f}: beyond "
                               f"{100 * MODEL_TOLERANCE:g} %")
                    elif verify and same_counts.backward in plans:  # realised, but the variants tie in the model
                        other = plans[same_counts.backward]
                        other_ms = _makespan(other.ops, same_counts.backward, current, stage_to_rank)
                        if abs(other_ms / deployed_ms - 1.0) <= MODEL_TOLERANCE:
                            why = (f"{same_counts.backward} predicted {other_ms:.1f} ms, {running} {deployed_ms:.1f}: "
                                   f"within {100 * MODEL_TOLERANCE:g} %, a tie the model cannot rank")
                    if why is not None:
                        probe = plans.get(same_counts.backward) or plan(current[same_counts.backward], same_counts)
                        cand = prepare(probe.ops, probe.warmup_counts, kind, f"{reason} ({why})",
                                       probe.inflight_limit)()
                        cand.plan_ms, cand.trigger = 1e3 * (now() - t0), "probe"
                        return cand
                    if verify_only:
                        return stay(f"measured {measured_ms:.1f} ms, predicted {deployed_ms:.1f}: within "
                                    f"{100 * MODEL_TOLERANCE:g} %" if verify else f"fewer than {window} spans measured",
                                    1e3 * (now() - t0))
                made = choice.pick(list(plans.values()), running)
                plan_ms = 1e3 * (now() - t0)
                if refine and not _pays(_makespan(made.ops, backward_of(made.ops), current, stage_to_rank),
                                        deployed_ms):
                    return stay(f"no plan {100 * REFINE_MARGIN:g} % faster", plan_ms)
                cand = prepare(made.ops, made.warmup_counts, kind, reason, made.inflight_limit)()
                cand.plan_ms, cand.trigger = plan_ms, decision.action
                if made.schedule != "explicit":
                    cand.plan = made  # planner-made: what the anytime polish starts from
                return cand

        return job, reason


def _makespan(ops: Any, backward: str, current: dict, stage_to_rank: dict[int, int]) -> float:
    """The simulator's makespan of ``ops`` under the current estimate of its own backward variant (what a
    refine compares and predicts; the planner's own prediction adds head-room to the delays)."""
    return simulate(ops, current[backward], stage_to_rank=stage_to_rank).makespan_ms


def _pays(made_ms: float, deployed_ms: float) -> bool:
    """A refined plan replaces the deployed one: predicted ``REFINE_MARGIN`` faster."""
    return made_ms < (1.0 - REFINE_MARGIN) * deployed_ms
