"""Per-iteration metrics of an adaptive schedule: a typed record, published as a plain dict.

``schedule.last_metrics`` stays a ``dict`` with these field names as keys (TorchTitan's logger, W&B
and ``titan_ext.titan.trainer`` read it by name); ``extra`` holds the observers' keys (``falcon/*``,
delegation's ``delegating`` …), merged in flat.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["IterationMetrics"]

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
    exchange_ms: float = 0.0  # the control-plane profile all_gather
    boundary_ms: float = 0.0  # the whole boundary on the critical path
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
