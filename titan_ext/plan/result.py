"""The one result type every planner returns (PipeMorph, CrossPipe and its variants, virtual placements,
the CP-SAT optimum, torch's built-ins).

A ``PlanResult`` is a compute-only plan in the plan IR (``ops``: ``(stage, kind, microbatch)`` tuples per
rank, ``plan/ir.py``) plus what the planner knows about it. Planners build it with :func:`make_result`,
which derives every field that follows from the plan itself (warm-up counts, in-flight and memory
peaks), so the fields mean the same whoever planned. Consumers (CLI, runtime, benchmarks) read only
these names. ``ops`` is the one stored copy of the plan: ``actions`` (torch's ``_Action`` lists, for the
CLI and the exporters) is derived from it on first read, and the runtime converts ``ops`` itself, in
its one lowering pass (``runtime/control/deploy.py``).

Memory units: one *activation* is what one microbatch's forward leaves behind on one stage of the
rank-level pipeline (the unit of ``--memory-limit`` and of Alg.1's x_max). A plan with V stages per
rank (virtual stages, CrossWave's half chunks) holds 1/V of that per stage activation
(``plan.placement.stage_profile`` splits a rank's memory evenly, as it splits its times).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping, Sequence

from . import ir
from .ir import Op, as_ops, stage_to_rank_map
from .placement import read_placement, stages_per_rank
from .profile import released_by
from .profile import PipelineProfile
from .warmup import slackness


@dataclass
class PlanResult:
    """A compute-only plan and how it was made."""

    ops: dict[int, list[Op]] = field(repr=False)
    """the plan: rank → ``(stage, kind, microbatch)`` tuples (F, I, W or full B; compute only) — the one IR
    from the planner to the runtime."""
    schedule: str
    """the name the plan was asked for (``plan_by_name``'s name, e.g. ``"pipemorph"``, ``"1F1B"``)."""
    source: str
    """the candidate that won (e.g. ``"pipemorph:alg2-floor2"``, ``"torch:ZBVZeroBubble"``); the
    schedule's name when the planner compares none."""
    warmup_counts: list[int]
    """x_s per stage: forwards stage s runs before its first backward (planned, or read off the plan)."""
    predicted_makespan_ms: float
    """makespan of the plan under the planner's timing model and ``profile``."""
    peak_inflight: dict[int, int]
    """stage → most activations of that stage held at once (F done − I/B done), in program order."""
    peak_memory_per_stage: dict[int, float]
    """stage → ``peak_inflight`` in activations (module docstring: a stage of a V-stages-per-rank plan
    holds 1/V activation per microbatch)."""
    peak_memory_per_rank: dict[int, float]
    """rank → the most activations held at once over all its stages, in program order."""
    plan_ms: float
    """wall time of planning + our validation (imports excluded)."""
    stage_to_rank: tuple[int, ...]
    """stage → rank (``plan.placement``)."""
    profile: PipelineProfile | None = field(default=None, repr=False)
    """the stage-level profile ``predicted_makespan_ms`` was computed under (simulate the plan with it)."""
    inflight_limit: list[int] | None = None
    """per-stage in-flight limit the plan was validated against (None: no limit)."""
    notes: list[str] = field(default_factory=list)
    """human-readable remarks the caller should see (e.g. "Alg.2 has no room: N ≤ 2S")."""
    candidates: dict[str, float | None] = field(default_factory=dict)
    """candidate name → predicted makespan (ms) of every candidate the planner compared (None: given up
    once it was certain to be slower than the best so far)."""
    info: dict[str, Any] = field(default_factory=dict)
    """planner-specific JSON-able facts (CrossPipe's greedy knobs, the solver's status and bound)."""

    @cached_property
    def actions(self) -> dict[int, list[Any]]:
        """rank → list of torch ``_Action`` (F, I, W or full B; torch's lowering adds SEND/RECV): ``ops``
        converted on first read (``plan.ir.to_torch_plan``), for the CLI and the exporters. Not a second
        copy of the plan: the runtime never reads it (it converts ``ops`` in its lowering pass)."""
        return ir.to_torch_plan(self.ops)

    @property
    def slackness(self) -> list[int]:
        """Δ_s = x_s − x_{s+1} of the plan's warm-up counts (PipeMorph §4.1)."""
        return slackness(self.warmup_counts)

    @property
    def stages_per_rank(self) -> int:
        return stages_per_rank(self.stage_to_rank)

    @property
    def placement(self) -> str:
        """"loop" or "v" (``plan.placement``); one stage per rank reads as "loop"."""
        return read_placement(self.stage_to_rank)

    def summary(self) -> dict:
        """JSON-able fields (no actions) for the CLI and logs."""
        return {
            "schedule": self.schedule,
            "source": self.source,
            "warmup_counts": list(self.warmup_counts),
            "slackness": self.slackness,
            "predicted_makespan_ms": self.predicted_makespan_ms,
            "peak_inflight": {str(s): v for s, v in sorted(self.peak_inflight.items())},
            "peak_memory_per_stage": {str(s): v for s, v in sorted(self.peak_memory_per_stage.items())},
            "peak_memory_per_rank": {str(r): v for r, v in sorted(self.peak_memory_per_rank.items())},
            "stage_to_rank": list(self.stage_to_rank),
            "plan_ms": round(self.plan_ms, 3),
            "notes": list(self.notes),
            "candidates": dict(self.candidates),
            **self.info,
        }


def make_result(
    plan: Mapping[int, Sequence[Any]],
    *,
    schedule: str,
    predicted_makespan_ms: float,
    plan_ms: float,
    stage_to_rank: Sequence[int] | None = None,
    source: str | None = None,
    warmup_counts: Sequence[int] | None = None,
    ops_checked: bool = False,
    inflight: Mapping[int, int] | None = None,
    **fields: Any,
) -> PlanResult:
    """A :class:`PlanResult` for ``plan`` (op tuples, or torch actions: read into op tuples with
    ``as_ops``), deriving what follows from the plan: warm-up counts (when not planned), in-flight and
    memory peaks. ``stage_to_rank`` defaults to the plan's own placement; ``fields``: the optional fields.
    ``ops_checked=True``: ``plan`` is the planner's own op tuples (rank → list), taken as they are (no
    second pass over a large plan); ``inflight``: the per-stage peaks when the planner has them
    (``validate_plan`` returns them). Torch actions are not stored: ``PlanResult.actions`` derives them."""
    ops = {int(r): o for r, o in plan.items()} if ops_checked else as_ops(plan)
    if stage_to_rank is None:
        stage_to_rank = _read_stage_to_rank(ops)
    s2r = tuple(int(r) for r in stage_to_rank)
    release = fields["profile"].release if fields.get("profile") is not None else "I"
    inflight = peak_inflight(ops, release) if inflight is None else dict(inflight)
    V = stages_per_rank(s2r)
    return PlanResult(
        ops=ops, schedule=schedule, source=source or schedule,
        warmup_counts=list(warmup_counts) if warmup_counts is not None else warmup_counts_of(ops),
        predicted_makespan_ms=predicted_makespan_ms, peak_inflight=inflight,
        peak_memory_per_stage={s: inflight.get(s, 0) / V for s in range(len(s2r))},
        peak_memory_per_rank=_rank_peaks(ops, inflight, s2r, release), plan_ms=plan_ms, stage_to_rank=s2r, **fields,
    )


def _read_stage_to_rank(ops: Mapping[int, Sequence[Op]]) -> tuple[int, ...]:
    placed = stage_to_rank_map(ops)
    return tuple(placed[s] for s in range(len(placed)))


def _rank_peaks(ops: Mapping[int, Sequence[Op]], inflight: Mapping[int, int], s2r: Sequence[int],
                release: str = "I") -> dict[int, float]:
    """Per-rank memory peaks; with one stage per rank they are that stage's (no second pass)."""
    if stages_per_rank(s2r) > 1:
        return peak_memory_per_rank(ops, s2r, release)
    return {r: float(inflight.get(s, 0)) for s, r in sorted(enumerate(s2r), key=lambda sr: sr[1])}


def peak_inflight(ops: Mapping[int, Sequence[Op]], release: str = "I") -> dict[int, int]:
    """Per stage, the most microbatches whose F is done and whose I (``release="W"``: W) or full B is not,
    in program order (``profile.RELEASES``)."""
    frees = released_by(release)
    peak: dict[int, int] = {}
    for rank_ops in ops.values():
        held: dict[int, int] = {}
        for stage, kind, _ in rank_ops:
            if kind == "F":
                held[stage] = held.get(stage, 0) + 1
                peak[stage] = max(peak.get(stage, 0), held[stage])
            elif kind in frees:
                held[stage] = held.get(stage, 0) - 1
    return dict(sorted(peak.items()))


def rank_peak_inflight(plan: Mapping[int, Sequence[Any]], release: str = "I") -> dict[int, int]:
    """Per rank, the most activations held at once over all its stages (F done − I/B done, in program
    order, which is exact: a rank runs its operations one at a time; ``release="W"``: F done − W/B done)."""
    frees = released_by(release)
    out = {}
    for rank, rank_ops in sorted(as_ops(plan).items()):
        held = peak = 0
        for _, kind, _ in rank_ops:
            held += 1 if kind == "F" else -1 if kind in frees else 0
            peak = max(peak, held)
        out[rank] = peak
    return out


def peak_memory_per_rank(plan: Mapping[int, Sequence[Any]], stage_to_rank: Any = None,
                         release: str = "I") -> dict[int, float]:
    """Per rank, its peak activation memory in units of one activation of the rank's whole model part:
    a chunk of a rank that holds V stages counts 1/V. One stage per rank: the stage's peak,
    so one-stage and multi-stage plans (ours and torch's) compare in one unit. ``stage_to_rank``
    (optional, any mapping or sequence) names the stages a rank holds; else the plan's own."""
    ops = as_ops(plan)
    if stage_to_rank is None:
        held = {rank: len({s for s, _, _ in rank_ops}) for rank, rank_ops in ops.items()}
    else:
        pairs = stage_to_rank.items() if hasattr(stage_to_rank, "items") else enumerate(stage_to_rank)
        held = {}
        for _, r in pairs:
            held[r] = held.get(r, 0) + 1
    return {rank: peak / max(held.get(rank, 1), 1) for rank, peak in rank_peak_inflight(ops, release).items()}


def warmup_counts_of(plan: Mapping[int, Sequence[Any]]) -> list[int]:
    """x_s of any compute-only plan, per stage: the forwards stage s runs before its first backward
    (PipeMorph §4.1's warm-up count; with one stage per rank, per rank)."""
    counts: dict[int, int] = {}
    done: set[int] = set()
    for rank_ops in as_ops(plan).values():
        for s, k, _ in rank_ops:
            counts.setdefault(s, 0)
            if s in done:
                continue
            if k == "F":
                counts[s] += 1
            else:
                done.add(s)
    return [counts[s] for s in sorted(counts)]


def rank_warmup_counts_of(plan: Mapping[int, Sequence[Any]]) -> list[int]:
    """Per rank, the forwards it runs (over all its stages) before its first backward — a different
    number from :func:`warmup_counts_of` when a rank holds several stages."""
    out = []
    ops = as_ops(plan)
    for rank in sorted(ops):
        n = 0
        for _, kind, _ in ops[rank]:
            if kind != "F":
                break
            n += 1
        out.append(n)
    return out
