"""Choosing between split (I + W) and full (B) backward plans.

``backward="auto"`` (the default) decides by the model, from measured times, without deploying a probe:

1. the initial plan runs the split plan with every odd microbatch's backward fused (B in place of its
   I, its W dropped: :func:`mixed_backward`), so the first iteration measures t_I, t_W *and* t_B on
   every stage, at no extra plan version and less memory than the split plan;
2. every planner-made re-plan (calibrate, adapt, shrink) plans both variants, each under its own
   measured profile, and keeps the faster predicted makespan (:func:`faster_by_model`; split must win by
   ``backward_margin``; on a tie full, which runs half the backward actions).  A healthy job therefore deploys two
   plans: the initial and the calibrated;
3. where a plan runs more than 5 % above its prediction, the model is not trusted to rank the variants:
   the refine (``control/regime.py``) starts the measured probe below instead (:meth:`BackwardChooser.start_probe`),
   and its verdict (:meth:`BackwardChooser.reusable`) names the variant of the re-plans that follow.

``backward="measure"`` is the measured probe below (:class:`BackwardChooser`) after every new regime, for
hardware where the simulator's makespan does not rank the variants right (ranks sharing cores).

Splitting the backward lets W fill pipeline bubbles (ZeroBubble; PipeMorph §3.1 plans with I and W),
but whether that pays depends on the hardware: on CPU autograd I + W costs more than one full
backward, and ranks sharing cores gain nothing from filled bubbles. The simulator cannot know either,
so the choice is made from measured iteration spans, once per regime (a regime = a plan the policy
chose: calibration, adapt, shrink):

1. the regime's plan runs ``window`` iterations;
2. **probe** — the other variant, with the *same* warm-up counts (same memory; for a full probe of a
   split plan the Eq.1 tolerance only grows, since t_B of a full backward ≥ t_I), runs ``window``
   iterations;
3. **select** — the variant with the lower median span stays; split must win by ``margin`` (on a tie full,
   which runs half the backward actions, as the model's first choice does: split's extra host work must
   pay for itself beyond the spans' noise; a probe of full, the usual case, then ends without a swap).

A probe whose plan the policy finds breaking Eq.1 (an adapt while it runs) is aborted in favour of the
regime's variant, so probing can never start a re-planning loop; a shrink waits for the verdict. A verdict is reused for later
regimes while the measured link delays stay within the policy's margins, for ``reuse_iterations``
iterations, so noisy re-plans do not pay for a probe each time.

Pure logic: the schedule feeds it the agreed spans and the policy's decision; all ranks see the same
inputs and reach the same decisions.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .policy import Decision

VARIANTS = ("split", "full")


def mixed_backward(ops: dict[int, list[tuple[int, str, int]]]) -> dict[int, list[tuple[int, str, int]]]:
    """A split plan with every odd microbatch's backward fused: its I becomes B and its W is dropped.

    Dependencies hold (B_m stands where I_m stood and produces what I_m and W_m did); in-flight memory only
    falls (an activation is freed at B_m instead of at W_m)."""
    return {r: [(s, "B" if k == "I" and m % 2 else k, m) for s, k, m in rank_ops if not (k == "W" and m % 2)]
            for r, rank_ops in ops.items()}


def faster_by_model(split: Any, full: Any, margin: float, running: str | None = None) -> Any:
    """The plan to deploy of the two variants' plans (``PlanResult``): the ``running`` variant unless the
    other's predicted makespan beats it by more than ``margin`` (relative; measured times jitter, and a
    flip is a new plan); with none running (the mixed first plan) the predicted-faster, full on a tie —
    there is no plan to keep, and a margin would only be a bias (at 1F1B's memory with no delay it kept
    1F1B's own full plan, predicted 2–3 % slower than the split one and measured 3–6 % slower).

    Both plans come from the planning profile (``Estimator.planning_profile``), whose actions include the
    executor's measured per-action cost, so the split plan pays for its extra action per microbatch (I + W
    against one B: on a CPU the executor's Python and transport calls, on a GPU launch gaps).  On a tie the
    full backward wins: it also frees an activation at its B."""
    plans = {"split": split, "full": full}
    cost = {v: p.predicted_makespan_ms for v, p in plans.items()}
    if running not in plans:
        return split if cost["split"] < cost["full"] else full
    keep = running
    other = "split" if keep == "full" else "full"
    if cost[other] < cost[keep] * (1.0 - margin):
        return plans[other]
    return plans[keep]


def other_variant(variant: str) -> str:
    return "full" if variant == "split" else "split"


@dataclass
class BackwardChooser:
    window: int = 3
    margin: float = 0.02
    enabled: bool = True
    reuse_iterations: int = 50
    delay_rel_margin: float = 0.10
    delay_abs_margin_ms: float = 1.0
    log: Callable[..., object] = field(default=lambda **_: None, repr=False)

    spans: dict[str, list[float]] = field(default_factory=lambda: {v: [] for v in VARIANTS})
    target: str | None = None  # variant being probed
    #: (variant, warm-up counts, in-flight limit) of the regime's plan: a probe keeps its memory
    base: tuple[str, list[int], list[int] | None] | None = None
    decided: bool = False
    verdict: tuple[str, tuple[float, ...], int] | None = None  # (winner, link delays, iteration)

    def __post_init__(self) -> None:
        self.decided = not self.enabled

    def new_regime(self) -> None:
        """A plan chosen by the policy was deployed: compare afresh."""
        self.spans = {v: [] for v in VARIANTS}
        self.target, self.base, self.decided = None, None, not self.enabled

    def record(self, variant: str, span_ms: float) -> None:
        self.spans[variant].append(span_ms)

    @property
    def probing(self) -> bool:
        return self.target is not None and not self.decided

    def _similar(self, delays: Sequence[float]) -> bool:
        _, then, _ = self.verdict
        return len(then) == len(delays) and all(
            abs(a - b) <= self.delay_rel_margin * max(a, b) + self.delay_abs_margin_ms for a, b in zip(then, delays))

    def step(self, policy: Decision, running: str, counts: Sequence[int], mode: str,
             delays: Sequence[float], iteration: int, inflight_limit: Sequence[int] | None = None) -> Decision:
        """The decision to act on at this boundary, given the policy's and the variant that just ran
        (its warm-up ``counts`` and ``inflight_limit``: a probe or a selection keeps both)."""
        if self.decided:
            return policy
        n = self.window
        limit = list(inflight_limit) if inflight_limit is not None else None
        if self.target is not None:
            base_variant, base_counts, base_limit = self.base
            if running != self.target:  # the probe plan was refused (the deploy path logged why)
                self.decided = True
                return policy
            if policy.action == "shrink":  # not urgent: after the verdict
                policy = Decision("keep", f"shrink deferred until the backward probe ends ({policy.reason})")
            elif policy.replans:  # adapt: the probe's plan breaks Eq.1; back to the regime's variant
                self.decided = True
                self.verdict = (base_variant, tuple(delays), iteration)
                reason = f"backward=auto: probe of {self.target} aborted ({policy.action}: {policy.reason})"
                self.log(decision="select", reason=reason, backward=base_variant)
                return Decision("select", reason, mode=mode, backward=base_variant, warmup_counts=list(base_counts),
                                inflight_limit=base_limit)
            if len(self.spans[self.target]) < n:
                return policy
            med = {v: statistics.median(s[-n:]) for v, s in self.spans.items()}
            best = "split" if med["split"] < med["full"] * (1 - self.margin) else "full"
            self.decided = True
            self.verdict = (best, tuple(delays), iteration)
            reason = (f"backward=auto: median span split {med['split']:.1f} ms, full {med['full']:.1f} ms "
                      f"(margin {100 * self.margin:g} %) -> {best}")
            self.log(decision="select", reason=reason, backward=best)
            if best == running:
                return policy
            return Decision("select", reason, mode=mode, backward=best, warmup_counts=list(base_counts),
                            inflight_limit=base_limit)
        if policy.action not in ("keep", "hold") or len(self.spans[running]) < n:
            return policy
        winner = self.reusable(delays, iteration)
        if winner is not None:
            self.decided = True
            reason = f"backward=auto: link delays as at iteration {self.verdict[2]}: {winner} (verdict reused)"
            self.log(decision="select", reason=reason, backward=winner)
            if winner == running:
                return policy
            return Decision("select", reason, mode=mode, backward=winner, warmup_counts=list(counts),
                            inflight_limit=limit)
        reason = self.start_probe(running, counts, limit)
        return Decision("probe", reason, mode=mode, backward=self.target, warmup_counts=list(counts),
                        inflight_limit=limit)

    def reusable(self, delays: Sequence[float], iteration: int) -> str | None:
        """The measured verdict's variant while it holds: taken ``reuse_iterations`` or fewer iterations ago,
        at link delays within the margins of ``delays``; else None."""
        if self.verdict is not None and iteration - self.verdict[2] <= self.reuse_iterations and self._similar(delays):
            return self.verdict[0]
        return None

    def start_probe(self, running: str, counts: Sequence[int], limit: list[int] | None, why: str = "") -> str:
        """Measure the other variant, with the running plan's warm-up ``counts`` and in-flight ``limit``
        (same memory), for ``window`` checks; :meth:`step` then selects by the median spans (split must
        win by ``margin``).  Returns the reason (logged)."""
        n = self.window
        self.decided, self.target, self.base = False, other_variant(running), (running, list(counts), limit)
        reason = (f"backward=auto: measure {self.target} backward for {n} iterations with warm-up counts "
                  f"{list(counts)} ({running}: median span {statistics.median(self.spans[running][-n:]):.1f} ms"
                  f"{why})")
        self.log(decision="probe", reason=reason, backward=self.target)
        return reason


class BackwardChoice:
    """The backward variant of each new plan, one part of an adaptive schedule: ``auto`` plans both
    variants and keeps the faster by the model (:func:`faster_by_model`; the initial plan mixed, to measure
    t_B too: :func:`mixed_backward`), ``measure`` probes (:class:`BackwardChooser`), ``split``/``full`` fixed.
    ``choose``: the layout lets the variant be chosen (one stage per rank; several: the portfolio picks)."""

    def __init__(self, configured: str, choose: bool, window: int, margin: float, log: Callable[..., object],
                 delay_rel_margin: float, delay_abs_margin_ms: float):
        self.configured, self.margin = configured, margin
        self.by_model = choose and configured == "auto"
        self.chooser = BackwardChooser(window, margin, enabled=choose and configured == "measure", log=log,
                                       delay_rel_margin=delay_rel_margin, delay_abs_margin_ms=delay_abs_margin_ms)

    def variant(self, decision: Decision | None, deployed: Any) -> str:
        """The variant a new plan gets: the decision's, else that of the deployed planner-made plan (the
        variant ``auto`` chose), else the configured one (``auto`` starts split)."""
        if decision is not None and decision.backward is not None:
            return decision.backward
        if deployed is not None and deployed.kind in ("initial", "adaptive") and deployed.backward != "mixed":
            return deployed.backward
        return "full" if self.configured == "full" else "split"

    def initial_ops(self, ops: dict, adaptive: bool) -> dict:
        """The initial plan's actions: mixed under ``auto`` (it measures I, W and B in one iteration)."""
        return mixed_backward(ops) if self.by_model and adaptive else ops

    def variants(self, decision: Decision, deployed: Any, full_backward_ms: Sequence[float]) -> tuple[str, ...]:
        """The variants to plan for ``decision``: both under ``auto`` once full backwards were measured
        (``full_backward_ms``: the window's median B per stage) and the decision names no plan of its own."""
        both = (self.by_model and decision.backward is None and decision.warmup_counts is None
                and decision.actions is None and not any(map(math.isnan, full_backward_ms)))
        return VARIANTS if both else (self.variant(decision, deployed),)

    def pick(self, plans: Sequence[Any], running: str | None) -> Any:
        """The plan to deploy of those planned for :meth:`variants` (in their order)."""
        return faster_by_model(*plans, self.margin, running) if len(plans) == 2 else plans[0]
