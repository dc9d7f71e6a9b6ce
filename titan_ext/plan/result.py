"""The one result type every planner returns (PipeMorph, CrossPipe, optimal, torch's built-ins).

A ``PlanResult`` is a compute-only plan in torch's IR plus what the planner knows about it. Planners
fill every field; consumers (CLI, runtime, benchmarks) read only these names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from .ir import Op
from .warmup import slackness


@dataclass
class PlanResult:
    """A compute-only plan and how it was made."""

    actions: dict[int, list[Any]]
    """rank → list of torch ``_Action`` (F, I, W or full B; torch's lowering adds SEND/RECV)."""
    ops: dict[int, list[Op]] = field(repr=False)
    """the same plan as ``(stage, kind, microbatch)`` tuples."""
    schedule: str
    """the planner (or the winning candidate) that made the plan, e.g. ``"pipemorph"``, ``"zb"``."""
    warmup_counts: list[int]
    """x_i: forwards each rank runs before its first backward, in program order."""
    predicted_makespan_ms: float
    """makespan of the plan under the planner's timing model and the profile it was given."""
    peak_inflight: dict[int, int]
    """stage → most activations held at once (F done − I/B done), in program order."""
    plan_ms: float
    """wall time of planning + our validation (imports excluded)."""
    stage_to_rank: dict[int, int] = field(default_factory=dict)
    """stage → rank; one stage per rank (identity) unless the planner places several."""
    inflight_limit: list[int] | None = None
    """per-stage in-flight limit the plan was validated against (None: no limit)."""
    notes: list[str] = field(default_factory=list)
    """human-readable remarks the caller should see (e.g. "Alg.2 has no room: N ≤ 2S")."""
    candidates: dict[str, float | None] = field(default_factory=dict)
    """candidate name → predicted makespan (ms) of every candidate the planner compared (None: given up
    once it was certain to be slower than the best so far)."""

    @property
    def slackness(self) -> list[int]:
        """Δ_i = x_i − x_{i+1} of the plan's warm-up counts (PipeMorph §4.1)."""
        return slackness(self.warmup_counts)

    def summary(self) -> dict:
        """JSON-able fields (no actions) for the CLI and logs."""
        return {
            "schedule": self.schedule,
            "warmup_counts": list(self.warmup_counts),
            "slackness": self.slackness,
            "predicted_makespan_ms": self.predicted_makespan_ms,
            "peak_inflight": {str(s): v for s, v in sorted(self.peak_inflight.items())},
            "plan_ms": round(self.plan_ms, 3),
            "notes": list(self.notes),
            "candidates": dict(self.candidates),
        }


def warmup_counts_of(ops: Mapping[int, Sequence[Op]]) -> list[int]:
    """x_i as written in a plan: the forwards each rank runs before its first backward."""
    out = []
    for rank in sorted(ops):
        n = 0
        for _, kind, _ in ops[rank]:
            if kind != "F":
                break
            n += 1
        out.append(n)
    return out
