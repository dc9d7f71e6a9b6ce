"""Boundary observers, and the narrow view of the schedule they (and the transport) get.

After the schedule has exchanged profiles, decided and (maybe) swapped a plan, it calls each observer's
``observe(boundary)`` with what every rank agreed on (:class:`Boundary`); the returned dict joins
``last_metrics``.  Observers are built outside the schedule (``runtime/control/extensions.py``: Falcon,
delegation's slow-link switch, or the user's) and see the schedule only through a
:class:`ScheduleContext`: its group and stage map, control plane, device layer, iteration count, the
decision log, and the one switch an observer may flip (re-planning on, Falcon §5's PP-link
mitigation) — never the schedule's private state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

__all__ = ["Boundary", "BoundaryObserver", "FalconObserver", "ScheduleContext"]


@dataclass(frozen=True)
class ScheduleContext:
    """What an observer or a transport may read from, and do to, the schedule it is attached to."""

    name: str  # the schedule's class name (error messages)
    group: Any  # the PP data process group
    num_stages: int
    n_microbatches: int
    control: Any  # the control plane over the PP ranks (runtime/comm/control_plane.py: gather_ints, any, agree)
    device: Callable[[], Any]  # the device layer now (runtime/execute/device.py; tests may swap it)
    stage_to_rank: Callable[[], dict[int, int]]  # the deployed plan's stage → PP rank map
    iteration: Callable[[], int]  # iterations completed
    in_iteration: Callable[[], bool]  # an iteration is running (switches happen only between them)
    log: Callable[..., dict]  # append to the schedule's decision_log
    adaptive: Callable[[], bool]  # re-planning from live profiles is on
    enable_adaptation: Callable[[str, str], None]  # switch re-planning on: (who, why), logged


@dataclass
class Boundary:
    """One iteration boundary as the schedule saw it."""

    context: ScheduleContext
    iteration: int
    iteration_ms: float  # this rank's action-loop wall time
    exchanged: bool  # profiles were exchanged (a check); otherwise only local numbers exist
    span_ms: float = math.nan  # agreed timeline span (NaN without an exchange)
    links: list[dict] = field(default_factory=list)  # per-link delay estimates of this iteration
    probe: bool = False  # the iteration ran the schedule's own backward probe, not the user's regime
    metrics: dict = field(default_factory=dict)  # the schedule's metrics of this boundary (earlier observers' too)


class BoundaryObserver(Protocol):
    """``attach(context)`` once, when the schedule is built; ``observe(boundary)`` at every boundary.
    ``every_iteration``: the observer needs a profile exchange at every iteration (the check period
    then never grows, Falcon's change-point detector)."""

    every_iteration: bool

    def attach(self, context: ScheduleContext) -> None: ...

    def observe(self, boundary: Boundary) -> dict[str, Any]: ...


class FalconObserver:
    """Falcon on the schedule's agreed numbers: the iteration time is the exchanged timeline's span and
    every PP link is one "group" (its per-iteration delay), so all ranks feed it identical numbers and
    reach identical decisions; its ``falcon/*`` entries (events, root cause, strategy, measured effect)
    join ``last_metrics``.  A slow PP link is mitigated by the schedule's own re-planning (switched on
    here if it was off); strategies that need the trainer are reported for it to apply."""

    every_iteration = True  # Falcon's change-point detection needs every iteration's agreed time

    def __init__(self, monitor: Any):
        self.monitor = monitor
        self.context: ScheduleContext | None = None

    @classmethod
    def create(cls, falcon: Any, num_stages: int, n_microbatches: int) -> "FalconObserver | None":
        """``falcon``: False/None (off), True (a default FalconMonitor) or a ready FalconMonitor."""
        if falcon is False or falcon is None:
            return None
        if falcon is not True:
            return cls(falcon)
        from ..falcon import FalconConfig, FalconMonitor

        config = FalconConfig(num_microbatches=n_microbatches)
        return cls(FalconMonitor(config, pp_groups={f"pp_link{i}": i for i in range(num_stages - 1)}))

    def attach(self, context: ScheduleContext) -> None:
        self.context = context

    def observe(self, boundary: Boundary) -> dict[str, Any]:
        # a probe of the other backward variant is the schedule's own doing, not a straggler: skipped
        if not boundary.exchanged or boundary.probe or not math.isfinite(boundary.span_ms):
            return {}
        per_link = {f"pp_link{i}": lk["c_ms"] / 1e3 for i, lk in enumerate(boundary.links)
                    if math.isfinite(lk["c_ms"])}
        out = self.monitor.observe(boundary.span_ms / 1e3, per_link)
        ctx = boundary.context
        if "pipemorph_replan" in out.get("falcon/apply", "").split(",") and not ctx.adaptive():
            # Falcon Alg.1 chose the PP-link mitigation: turn re-planning on (the policy then adapts
            # the slackness of the slow link at the next boundary)
            ctx.enable_adaptation("falcon", f"re-planning switched on for slow link {out.get('falcon/plan/pp_link')}")
        return out
