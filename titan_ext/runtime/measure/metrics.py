"""Per-iteration metrics of an adaptive schedule: a typed record, published as a plain dict.

``schedule.last_metrics`` stays a ``dict`` with these field names as keys (TorchTitan's logger, W&B
and ``titan_ext.titan.trainer`` read it by name); ``extra`` holds the observers' keys (``falcon/*``,
delegation's ``delegating`` …), merged in flat.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any

from titan_ext.plan.warmup import plan_slackness

__all__ = ["IterationMetrics", "MetricsRecord"]

_NAN = math.nan


@dataclass
class IterationMetrics:
    """One iteration as measured and decided at its boundary (all times in ms)."""

    iteration: int
    iteration_time_ms: float  # this rank's action loop as the device ran it (device layer; NaN: not resolved)
    bubble_rate: float = _NAN  # 1 − Σ busy / (S · T) over the exchanged timeline (NaN: no exchange)
    timeline_span_ms: float = _NAN  # T: first F on stage 0 → last op anywhere
    link_delay_ms: dict[int, float] = field(default_factory=dict)  # this iteration's c_i per link
    link_delay_fwd_ms: dict[int, float] = field(default_factory=dict)
    link_delay_bwd_ms: dict[int, float] = field(default_factory=dict)
    link_delay_estimate_ms: dict[int, float] = field(default_factory=dict)  # window median, planned with
    compute_ms: dict[str, list[float]] = field(default_factory=dict)  # F, I, W, B per stage (estimate)
    backward: str | None = None  # deployed plan's variant: split | full
    plan_version: int = 0
    plan_hash: str | None = None
    warmup_counts: list[int] | None = None
    slackness: list[int] | None = None
    eq1_tolerance_ms: list[float] | None = None
    replan_ms: float = 0.0  # critical-path cost of re-planning (the swap); planning is in background
    deployed: bool = False  # a new plan was swapped in at this boundary
    plan_ms: float = _NAN  # background planning + validation + lowering wall time
    plan_cpu_ms: float = _NAN  # its CPU time
    swap_ms: float = 0.0
    exchange_ms: float = 0.0  # the control-plane profile all_gather (posting it, or waiting for it)
    #: "" no check; "exchange" profiles exchanged and decided here; "posted" exchanged, decided at the next
    #: boundary (the check runs behind, ``control/cadence.py``); "decided" on the previous boundary's exchange
    check: str = ""
    boundary_ms: float = 0.0  # the whole boundary on the critical path
    #: the boundary's CPU on this thread (``time.thread_time``): what it costs a rank on a core of its own,
    #: without the time other processes held the core (``boundary_ms`` on a host the ranks share)
    boundary_cpu_ms: float = 0.0
    decision: str = "none"
    decision_reason: str = "no profile exchange this iteration"
    recv_wait_ms: float = 0.0  # compute thread blocked on receives
    inflight_cap: list[int] | None = None  # per-stage activation cap adaptive plans respect (None: none)
    memory_budget_bytes: float = _NAN  # the budget the cap came from
    profile_every: int = 1  # current k of the adaptive profiling period
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        out.update(self.extra)
        return out


class MetricsRecord:
    """An adaptive schedule's published metrics: the last iteration's (``last``), the history, the last
    exchanged profile, and what the estimator's windows and the deployed plan give (:meth:`fill_plan`)."""

    def __init__(self, size: int):
        self.history: deque[dict] = deque(maxlen=size)
        self.last: dict = {}
        self.last_profile: Any = None
        self._plan: tuple = (None,)  # (key, estimates, tolerances, compute, slackness)

    def fill_plan(self, m: IterationMetrics, links: list[dict], parts: Any, deployed: Any, version: int,
                  delegating: bool) -> None:
        """The per-link readings of this check and the plan-side fields of ``m``; the estimates are rebuilt
        only when the windows or the deployed plan changed (a check pushed rows, a plan was deployed), not
        at every boundary — their profiles are most of a boundary."""
        m.link_delay_ms = {i: lk["c_ms"] for i, lk in enumerate(links)}
        m.link_delay_fwd_ms = {i: lk["fwd_ms"] for i, lk in enumerate(links)}
        m.link_delay_bwd_ms = {i: lk["bwd_ms"] for i, lk in enumerate(links)}
        estimator = parts.estimator
        key = (estimator.version, version, deployed.hash)
        if self._plan[0] != key:
            est, est_full = estimator.profile(), estimator.profile("full")  # compute times as measured
            tolerances = parts.tolerances(estimator.planning_profile("split"),  # the policy's
                                          estimator.planning_profile("full"), deployed)
            self._plan = (key, list(parts.link_estimates_ms()), tolerances,
                          {"F": list(est.f_ms), "I": list(est.b_ms), "W": list(est.w_ms), "B": list(est_full.b_ms)},
                          plan_slackness(deployed.warmup_counts))
        _, estimates, tolerances, compute, slack = self._plan
        m.link_delay_estimate_ms = dict(enumerate(estimates))
        m.compute_ms = {k: list(v) for k, v in compute.items()}
        m.backward, m.plan_version, m.plan_hash = deployed.backward, version, hex(deployed.hash)
        m.warmup_counts, m.slackness = list(deployed.warmup_counts), None if slack is None else list(slack)
        m.eq1_tolerance_ms = list(tolerances)
        m.inflight_cap = parts.memory.adaptive_limit(delegating)
        budget = parts.memory.budget_bytes
        m.memory_budget_bytes = budget if budget is not None else _NAN

    def publish(self, m: IterationMetrics) -> None:
        self.last = m.as_dict()
        self.history.append(self.last)
