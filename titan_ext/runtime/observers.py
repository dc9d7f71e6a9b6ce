"""Boundary observers: components that watch every iteration boundary of an adaptive schedule.

After the schedule has exchanged profiles, decided and (maybe) swapped a plan, it calls each observer's
``observe(boundary)`` with what every rank agreed on (:class:`Boundary`); the returned dict joins
``last_metrics``.  An observer may act on the schedule (switch re-planning on, switch delegation) —
only here, between iterations.  Falcon (fail-slow detection, Falcon §4–§5) is one; delegation's
slow-link switch (``titan_ext.runtime.delegate.schedule.Delegation``) is another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["Boundary", "BoundaryObserver", "FalconObserver"]


@dataclass
class Boundary:
    """One iteration boundary as the schedule saw it."""

    schedule: Any
    iteration: int
    iteration_ms: float  # this rank's action-loop wall time
    exchanged: bool  # profiles were exchanged (a check); otherwise only local numbers exist
    span_ms: float = math.nan  # agreed timeline span (NaN without an exchange)
    links: list[dict] = field(default_factory=list)  # per-link delay estimates of this iteration
    probe: bool = False  # the iteration ran the schedule's own backward probe, not the user's regime
    metrics: dict = field(default_factory=dict)  # the schedule's metrics of this boundary (earlier observers' too)


class BoundaryObserver(Protocol):
    def observe(self, boundary: Boundary) -> dict[str, Any]: ...


class FalconObserver:
    """Falcon on the schedule's agreed numbers: the iteration time is the exchanged timeline's span and
    every PP link is one "group" (its per-iteration delay), so all ranks feed it identical numbers and
    reach identical decisions; its ``falcon/*`` entries (events, root cause, strategy, measured effect)
    join ``last_metrics``.  A slow PP link is mitigated by the schedule's own re-planning (switched on
    here if it was off); strategies that need the trainer are reported for it to apply."""

    def __init__(self, monitor: Any):
        self.monitor = monitor

    @classmethod
    def create(cls, falcon: Any, num_stages: int, n_microbatches: int) -> "FalconObserver | None":
        """``falcon``: False/None (off), True (a default FalconMonitor) or a ready FalconMonitor."""
        if falcon is False or falcon is None:
            return None
        if falcon is not True:
            return cls(falcon)
        from .falcon import FalconConfig, FalconMonitor

        config = FalconConfig(num_microbatches=n_microbatches)
        return cls(FalconMonitor(config, pp_groups={f"pp_link{i}": i for i in range(num_stages - 1)}))

    def observe(self, boundary: Boundary) -> dict[str, Any]:
        # a probe of the other backward variant is the schedule's own doing, not a straggler: skipped
        if not boundary.exchanged or boundary.probe or not math.isfinite(boundary.span_ms):
            return {}
        per_link = {f"pp_link{i}": lk["c_ms"] / 1e3 for i, lk in enumerate(boundary.links)
                    if math.isfinite(lk["c_ms"])}
        out = self.monitor.observe(boundary.span_ms / 1e3, per_link)
        sched = boundary.schedule
        if "pipemorph_replan" in out.get("falcon/apply", "").split(",") and not sched.adaptive:
            # Falcon Alg.1 chose the PP-link mitigation: turn re-planning on (the policy then adapts
            # the slackness of the slow link at the next boundary)
            sched.adaptive = True
            sched._log(decision="falcon", reason=f"re-planning switched on for slow link {out.get('falcon/plan/pp_link')}")
        return out
