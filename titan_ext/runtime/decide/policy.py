"""Re-planning policy with hysteresis (PipeMorph §4.2 "Dynamic adaptation", §6 "Straggler mitigation").

Every check sees the robust estimate (window medians) of per-stage compute times and per-link delays
and the deployed plan's warm-up counts, and returns a :class:`Decision`:

* ``adapt`` — some link's measured delay ``c_i`` breaks the deployed plan's Eq.1 tolerance
  ``tol_i = (Δ_i (t^F_{i+1} + t^B_{i+1}) − t^F_i − t^B_i) / 2`` by more than the up-margin
  (``c_i > tol_i·(1 + rel_margin) + abs_margin_ms``): re-plan with Alg.2 (``mode="adaptive"``) from
  the estimate, whose delays are inflated by the same margins (headroom against jitter).
* ``shrink`` — links recovered: the plan one would choose now (Alg.1's initial plan if it absorbs every
  measured delay with the margins, else Alg.2 from the estimate) holds less slackness than the deployed
  one, for ``recover_patience`` consecutive checks and at least ``min_dwell`` iterations after the
  last deployment: give the memory back.
* ``hold`` — a violation, but Alg.2 cannot give any violated link more slackness than deployed
  (clipped at N − 2S): re-planning would only reshuffle the other links on noise.
* ``keep`` — nothing to do.

Hysteresis: growing needs the violation to exceed the tolerance by the margin; shrinking needs the
smaller plan to absorb the delay *with* the margin, sustained for several checks, so a delay jittering
around one threshold cannot flap the plan.  Falcon's "≥10 % change, else jitter" rule is the default
``rel_margin``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, Sequence

from titan_ext.plan import PipelineProfile, adapted_warmup_counts, link_tolerances_ms, slackness
from titan_ext.args import ArgumentTypeError, choice_arg, counts_arg, int_arg, plan_arg, real_arg

__all__ = ["Decision", "Policy", "PolicySettings", "ReplanPolicy", "exact_arrival_links"]


@dataclass
class Decision:
    """What the policy decided at one check."""

    action: str  # keep | adapt | shrink | hold | calibrate | refine | verify | force | probe | select
    reason: str
    mode: str | None = None  # planner mode for a new plan: "initial" | "adaptive"
    backward: str | None = None  # "split" | "full" for a new plan (None: the deployed plan's)
    warmup_counts: list[int] | None = None  # explicit counts (force / tests), else the planner decides
    #: in-flight activations per stage a plan from ``warmup_counts`` may hold (None: the counts themselves)
    inflight_limit: list[int] | None = None
    actions: dict | None = None  # an explicit compute-only plan (force / tests)
    violated_links: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Types checked; ``action`` is any name a policy gives (the runtime's are above)."""
        if not (isinstance(self.action, str) and self.action):
            raise ArgumentTypeError(f"Decision action must be a non-empty name (keep, adapt, ...), got {self.action!r}")
        if not isinstance(self.reason, str):
            raise ArgumentTypeError(f"Decision reason must be text, got {self.reason!r}")
        if self.mode is not None:
            choice_arg(self.mode, "Decision mode", ("initial", "adaptive"))
        if self.backward is not None:
            choice_arg(self.backward, "Decision backward", ("split", "full", "mixed"))
        if self.warmup_counts is not None:
            counts_arg(self.warmup_counts, "Decision warmup_counts", minimum=0)
        if self.inflight_limit is not None:
            counts_arg(self.inflight_limit, "Decision inflight_limit", minimum=1)
        if self.actions is not None:
            plan_arg(self.actions, "Decision actions")
        counts_arg(self.violated_links, "Decision violated_links", minimum=0)

    @property
    def replans(self) -> bool:
        return self.action in ("adapt", "shrink", "calibrate", "refine", "verify", "force", "probe", "select")


@dataclass(frozen=True)
class PolicySettings:
    """Thresholds of the re-planning decision (PipeMorph §4.2 "Dynamic adaptation"; ``policy.py``).

    The layout's policy is built from them (one stage per rank: ``ReplanPolicy``; several:
    ``VirtualReplanPolicy``), and the parts that share them — check cadence, backward chooser, the
    planners' head-room on measured delays — read them here, whatever policy decides."""

    window: int = 3
    """Iterations in the robust window; estimates are medians over it."""
    rel_margin: float = 0.10
    """Relative margin over the Eq.1 tolerance before a link counts as slow (and planning head-room);
    Falcon's "≥10 % change, else jitter" rule."""
    abs_margin_ms: float = 1.0
    """Absolute margin (ms), covers timer noise on tiny tolerances."""
    recover_patience: int = 3
    """Consecutive checks that must agree before slackness shrinks (one stage per rank)."""
    min_dwell: int = 2
    """Iterations a deployed plan runs at least before it may shrink (one stage per rank)."""
    compute_rel_margin: float = 0.25
    """Several stages per rank: relative change of a rank's period that triggers a re-plan."""

    def __post_init__(self) -> None:
        check_thresholds(self)

    def headroom_delay(self, c_ms: float) -> float:
        """Delay a re-plan is asked to absorb for a measured one-way delay ``c_ms``."""
        return headroom_delay(c_ms, self.rel_margin, self.abs_margin_ms)


class Policy(Protocol):
    """A re-planning policy: at every check, ``decide`` turns the agreed estimate and the deployed plan's
    warm-up counts into a :class:`Decision` (identical inputs on every rank → identical decisions).

    ``window``: iterations of the robust window the estimator keeps for it.  ``forces``: its decisions
    apply even with ``adaptive=False`` (tests and external controllers that force plans).  The shared
    thresholds (margins, planning head-room) are :class:`PolicySettings` of the schedule's config, not
    attributes every policy must carry.  Optional: ``note_deployed(planned_for_ms)``, called at every swap
    with the per-link delays a planner-made plan was planned for (None otherwise), as
    :meth:`ReplanPolicy.note_deployed`."""

    window: int
    forces: bool

    def decide(self, estimate: PipelineProfile, deployed_counts: Sequence[int], initial_counts: Sequence[int],
               iterations_since_deploy: int, slack_floor: int = 2) -> Decision: ...


@dataclass
class ReplanPolicy:
    """Thresholds of the re-planning decision (see module docstring)."""

    window: int = 3
    """Iterations in the robust window; estimates are medians over it."""
    rel_margin: float = 0.10
    """Relative margin over the Eq.1 tolerance before a link counts as slow (and planning headroom)."""
    abs_margin_ms: float = 1.0
    """Absolute margin (ms), covers timer noise on tiny tolerances."""
    recover_patience: int = 3
    """Consecutive checks that must agree before slackness shrinks."""
    min_dwell: int = 2
    """Iterations a deployed plan runs at least before it may shrink."""

    forces: ClassVar[bool] = False
    _recover_streak: int = field(default=0, init=False, repr=False)
    _planned_for: list[float] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        check_thresholds(self)

    def note_deployed(self, planned_for_ms: Sequence[float] | None) -> None:
        """A plan was swapped in; ``planned_for_ms``: the per-link delays its planner absorbed (the
        measured ones with the head-room, ``PlanResult.profile``), None for a plan not made for measured
        delays (Alg.1's initial plan, a user's plan).

        The planner chooses by the simulator, which may keep less slackness on a slow link than Eq. 1
        asks for when that is faster; judged by Eq. 1 alone, such a plan is "violated" at once and the
        next check re-plans the same delay — and a recovery candidate with less slackness than the
        planner's choice "suffices" for the same delay — so a constant delay would churn.  With the
        delays it was planned for, a link is violated only when its delay grew past them, and a shrink
        needs a delay that fell below them by the margins: the hysteresis band of the module docstring,
        around the plan's own delays."""
        self._planned_for = list(planned_for_ms) if planned_for_ms is not None else None
        self._recover_streak = 0

    @classmethod
    def from_settings(cls, settings: PolicySettings, **extra) -> "ReplanPolicy":
        """The policy with ``settings``' thresholds (those of its fields ``settings`` has)."""
        names = {f.name for f in dataclasses.fields(cls) if f.init} & {f.name for f in dataclasses.fields(settings)}
        return cls(**{n: getattr(settings, n) for n in names}, **extra)

    def headroom_delay(self, c_ms: float) -> float:
        """Delay the planner is asked to absorb for a measured ``c_ms``."""
        return headroom_delay(c_ms, self.rel_margin, self.abs_margin_ms)

    def decide(
        self,
        estimate: PipelineProfile,
        deployed_counts: Sequence[int],
        initial_counts: Sequence[int],
        iterations_since_deploy: int,
        slack_floor: int = 2,
    ) -> Decision:
        S = estimate.num_stages
        delays = estimate.delays_ms
        tol = link_tolerances_ms(estimate, deployed_counts)
        # a link is slow only past the absolute margin itself: a plan whose tolerance is ≤ 0 (stages of
        # unequal speed) is not re-planned for a link reading of a few tenths of a millisecond
        planned = self._planned_for if self._planned_for is not None and len(self._planned_for) == S - 1 else None
        violated = [
            i for i in range(S - 1)
            if delays[i] > tol[i] * (1.0 + self.rel_margin) + self.abs_margin_ms
            and delays[i] > max(tol[i], 0.0) + self.abs_margin_ms
            and (planned is None or delays[i] > planned[i])  # grew past what the plan absorbs by simulation
        ]
        planning = estimate.with_delays({i: self.headroom_delay(c) for i, c in enumerate(delays)})
        if violated:
            self._recover_streak = 0
            desc = ", ".join(f"link {i}: c={delays[i]:.1f} ms > tol={tol[i]:.1f} ms" for i in violated)
            # within the memory the estimate carries (the runtime's caps): a capped plan that already holds
            # all it may cannot be helped by re-planning
            target = adapted_warmup_counts(planning, slack_floor=slack_floor, memory_limit=estimate.max_inflight())
            new_slack, old_slack = slackness(target), slackness(deployed_counts)
            if not any(new_slack[i] > old_slack[i] for i in violated):
                # Alg.2 cannot give a violated link more slackness (clipped at N-2S): re-planning would
                # only reshuffle the other links on measurement noise.
                return Decision("hold", f"Eq.1 violated ({desc}) but Alg.2 cannot add slackness there "
                                f"(clipped at N-2S or by the memory cap)", violated_links=violated)
            return Decision("adapt", f"Eq.1 violated ({desc})", mode="adaptive", violated_links=violated)

        # Recovery: what would we deploy now?
        initial_tol = link_tolerances_ms(estimate, initial_counts)
        absorbed_by_initial = all(self.headroom_delay(c) <= t or c <= 0 for c, t in zip(delays, initial_tol))
        if absorbed_by_initial:
            candidate, mode = list(initial_counts), "initial"
        else:
            candidate, mode = adapted_warmup_counts(planning, slack_floor=slack_floor,
                                                    memory_limit=estimate.max_inflight()), "adaptive"
        # a planner-made plan gives its slackness back only once a delay fell below what it was planned
        # for, by the margins (an unchanged delay re-planned would be the same plan)
        fell = planned is None or any(self.headroom_delay(delays[i]) < (planned[i] - self.abs_margin_ms) /
                                      (1.0 + self.rel_margin) for i in range(S - 1))
        if fell and candidate != list(deployed_counts) and sum(slackness(candidate)) < sum(slackness(deployed_counts)):
            self._recover_streak += 1
            if self._recover_streak >= self.recover_patience and iterations_since_deploy >= self.min_dwell:
                self._recover_streak = 0
                delays_txt = ", ".join(f"{c:.1f}" for c in delays)
                return Decision(
                    "shrink",
                    f"less slackness suffices (c = [{delays_txt}] ms): slackness {slackness(deployed_counts)} -> "
                    f"{slackness(candidate)}",
                    mode=mode,
                )
            return Decision("keep", f"recovery candidate {candidate} seen {self._recover_streak}/"
                            f"{self.recover_patience} checks")
        self._recover_streak = 0
        return Decision("keep", "every link within Eq.1 tolerance")


def check_thresholds(policy: Any) -> None:
    """The one check of the re-planning thresholds (:class:`PolicySettings`, :class:`ReplanPolicy` and the
    policies made from them): TypeError / ValueError naming the field; those a class lacks are skipped."""
    int_arg(policy.window, "policy window", 1)
    for name in ("rel_margin", "abs_margin_ms", "compute_rel_margin"):
        if hasattr(policy, name):
            real_arg(getattr(policy, name), f"policy {name}", minimum=0)
    for name in ("recover_patience", "min_dwell"):
        if hasattr(policy, name):
            int_arg(getattr(policy, name), f"policy {name}", 0)


def headroom_delay(c_ms: float, rel_margin: float, abs_margin_ms: float) -> float:
    """The delay a re-plan absorbs for a measured one-way delay (head-room against jitter, §4.2)."""
    return c_ms * (1.0 + rel_margin) + abs_margin_ms if c_ms > 0 else 0.0


def exact_arrival_links(tolerance_ms: Sequence[float] | None, planned_for_ms: Sequence[float] | None,
                        abs_margin_ms: float) -> set[int] | None:
    """The links whose arrivals need the watcher's exact stamps (PipeMorph §6 profiler): where the
    deployed plan can hide a delay — Eq. 1 tolerance above the policy's absolute margin (NaN: not known,
    exact), or a plan made for a delay beyond twice it.  On the other links the consumer waits as soon
    as its data is late, so its own stamp is exact whenever a delay matters, and a late one (an upper
    bound: the data waited for its consumer) stays below the tolerance, which is all the policy compares
    it with; there the watcher's thread hop between the data and its consumer is saved (gloo; on NCCL
    the watcher is never on the critical path).  None (every link): no tolerance yet.  One stage per
    rank (with several, ``control/parts.build_parts`` watches every link)."""
    if tolerance_ms is None:
        return None
    return ({i for i, t in enumerate(tolerance_ms) if not t <= abs_margin_ms}
            | {i for i, c in enumerate(planned_for_ms or ()) if c > 2 * abs_margin_ms})


def is_finite(x: float) -> bool:
    return not (math.isnan(x) or math.isinf(x))
