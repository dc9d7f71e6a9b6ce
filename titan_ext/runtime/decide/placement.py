"""Several stages per rank at run time (docs/multistage.md, docs/runtime.md).

``PipeMorph`` / ``CrossPipe`` take torch's convention for virtual stages: the list of this rank's
stages (``PipelineScheduleMulti``).  This module holds what changes when that list has V > 1 stages:

* :func:`read_layout` — the placement, read from the stage indices: "loop" when rank r holds
  r, r+R, r+2R, … (torch's Interleaved schedules), "v" when it holds r, 2R−1−r, … (ZBV / DualPipeV);
  anything else is refused with a one-line error;
* :class:`VirtualEstimator` — per-stage F/I/W/B windows (each rank reports one row per local stage) and
  per-*rank*-link delays, as the stage-level profile every rank plans from;
* :class:`VirtualPlanner` — ``plan_virtual`` (the portfolio: our virtual-stage Alg.3/4 generator with
  the virtual Eq.1 warm-up rule, torch's built-ins for the placement, CrossWave) or CrossWave alone;
* :class:`VirtualReplanPolicy` — re-plan when the measured profile moved beyond the hysteresis margin
  from the one the deployed plan was made for (the portfolio then re-picks by simulation).

The rest — exchange, agreement, torch's lowering passes, validation, the swap at an iteration boundary
— is the one-stage-per-rank path unchanged.  Pure of torch.distributed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from titan_ext.plan import LinkProfile, PipelineProfile, PlanResult
from titan_ext.plan.schedules import plan_by_name
from titan_ext.plan.ir import COMPUTE_KINDS
from titan_ext.plan.placement import PLACEMENTS, boundary_link, rank_profile, rank_stages, stage_to_rank
from titan_ext.plan.virtual import rank_periods_ms, virtual_link_tolerance_ms

from ..execute.memory import RELEASE
from ..measure.estimator import Estimator
from .policy import Decision, ReplanPolicy

__all__ = ["Layout", "VirtualEstimator", "VirtualPlanner", "VirtualReplanPolicy", "rank_level", "read_layout",
           "virtual_tolerances"]


@dataclass(frozen=True)
class Layout:
    """R ranks × V stages per rank, placed "loop" or "v" (V = 1: "loop", one stage per rank)."""

    num_ranks: int
    stages_per_rank: int
    placement: str
    stage_to_rank: tuple[int, ...]

    @property
    def virtual(self) -> bool:
        return self.stages_per_rank > 1

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def local_stages(self, rank: int) -> list[int]:
        return rank_stages(self.stage_to_rank, rank)

    def boundary_link(self, boundary: int) -> int | None:
        """The rank link carrying stage boundary s → s+1 (None: same rank, or loop wrap-around)."""
        return boundary_link(self.stage_to_rank, boundary)


def read_layout(local_stage_indices: Sequence[int], rank: int, num_ranks: int, num_stages: int) -> Layout:
    """The placement of the stages this rank holds (torch's stage indices); ValueError otherwise."""
    local = sorted(local_stage_indices)
    R, S = num_ranks, num_stages
    if S % R or len(local) != S // R:
        raise ValueError(f"rank {rank} holds {len(local)} stages of {S} on {R} ranks: every rank must hold "
                         f"the same number of stages (num_stages = ranks × stages per rank)")
    V = S // R
    for placement in PLACEMENTS:
        s2r = stage_to_rank(R, V, placement)
        if local == rank_stages(s2r, rank):
            return Layout(R, V, placement, s2r)
    expect = {p: rank_stages(stage_to_rank(R, V, p), rank) for p in PLACEMENTS}
    raise ValueError(f"rank {rank} holds stages {local}: neither looped ({expect['loop']}) nor V-shaped "
                     f"({expect['v']}) placement of {S} stages on {R} ranks")


def rank_level(staged: PipelineProfile, layout: Layout) -> tuple[PipelineProfile, tuple]:
    """(rank-level profile: R ranks, R−1 rank links; per-stage (f, b, w)) of a stage-level profile, the
    form ``plan_virtual`` takes (``plan.placement.rank_profile``)."""
    return rank_profile(staged, layout.stage_to_rank), (staged.f_ms, staged.b_ms, staged.w_ms)


class VirtualEstimator(Estimator):
    """Windows of per-stage F/I/W/B (S = R·V rows) and per-rank-link delays (R−1) → the stage-level
    profile (S stages; a boundary inside one rank or across the loop wrap-around has no delay)."""

    def __init__(self, layout: Layout, n_microbatches: int, window: int,
                 initial_times_ms: tuple[float, float, float] = (1.0, 1.0, 1.0)):
        super().__init__(layout.num_stages, n_microbatches, window, initial_times_ms)
        self.layout = layout

    def push(self, ranks: Sequence[Any], link_delays_ms: Sequence[float]) -> None:
        """``ranks[r].stage_ms``: one (F, I, W, B) row per local stage of rank r, in stage order."""
        rows: list[list[float]] = [[math.nan] * self.num_stages for _ in range(4)]
        for r, prof in enumerate(ranks):
            for s, times in zip(self.layout.local_stages(r), prof.stage_ms):
                for k in range(4):
                    rows[k][s] = times[k]
        for key, row in zip(COMPUTE_KINDS, rows):
            self.window.push(key, row)
        self.window.push("C", list(link_delays_ms)[: self.layout.num_ranks - 1])
        self.window.push("G", [r.gap_ms for r in ranks])

    def stage_rank(self) -> Sequence[int]:
        return self.layout.stage_to_rank

    def rank_link_delays_ms(self) -> list[float]:
        return [v if not math.isnan(v) else 0.0 for v in self.window.median("C", self.layout.num_ranks - 1)]

    def profile(self, backward: str = "split") -> PipelineProfile:  # noqa: ARG002 - one estimate for all
        """Split-backward stage times (I, W); a stage only measured with full backwards (a torch built-in
        ran) plans with I = B, W = 0 — the cost it showed."""
        S, win = self.num_stages, self.window
        f0, i0, w0 = self.initial_times_ms
        f, i, w, b = (win.median(k, S) for k in COMPUTE_KINDS)
        fs, bs, ws = [], [], []
        for s in range(S):
            fs.append(max(f[s], 1e-3) if not math.isnan(f[s]) else f0)
            if not math.isnan(i[s]):
                bs.append(max(i[s], 1e-3))
                ws.append(max(w[s], 0.0) if not math.isnan(w[s]) else w0)
            elif not math.isnan(b[s]):
                bs.append(max(b[s], 1e-3))
                ws.append(0.0)
            else:
                bs.append(i0)
                ws.append(w0)
        c = self.rank_link_delays_ms()
        links = tuple(LinkProfile(latency_ms=c[lk]) if (lk := self.layout.boundary_link(s)) is not None
                      else LinkProfile() for s in range(S - 1))
        return PipelineProfile(S, self.n_microbatches, tuple(fs), tuple(bs), tuple(ws), links, release=RELEASE)


class VirtualPlanner:
    """Plans R ranks × V stages: ``plan_virtual`` with ``schedule`` "pipemorph" (the portfolio) or
    "crosspipe-wave" (CrossWave, "v" with V = 2).  Every candidate is simulated under the measured
    stage-level profile (with the policy's head-room on link delays for re-plans) and the fastest kept;
    ``backward="split"`` leaves out torch's full-backward built-ins (Interleaved1F1B)."""

    def __init__(self, layout: Layout, schedule: str = "pipemorph", backward: str = "auto"):
        self.layout, self.schedule, self.backward = layout, schedule, backward
        self.backward_choices = ("auto", "split") if schedule == "pipemorph" else ("split",)

    def plan(self, profile: PipelineProfile, decision: Decision, context: Any) -> PlanResult:
        limit = context.x_max if decision.mode == "initial" else context.adaptive_limit
        if decision.mode != "initial":
            profile = profile.with_delays({k: context.headroom(c) for k, c in enumerate(profile.delays_ms)})
        ranks, times = rank_level(profile, self.layout)
        limit = None if limit is None or limit >= profile.num_microbatches else limit
        per_rank = getattr(context, "rank_memory_limit", None)
        if per_rank is not None and min(per_rank) >= profile.num_microbatches:
            per_rank = None  # no plan holds more than N per stage: no limit
        return plan_by_name(ranks, self.schedule, virtual_stages=self.layout.stages_per_rank,
                            placement=self.layout.placement, stage_times_ms=times, stage_memory_limit=limit,
                            memory_limit=None if per_rank is None else list(per_rank),
                            validate=False, full_backward=self.backward != "split")


@dataclass
class VirtualReplanPolicy(ReplanPolicy):
    """Re-plan (``adapt``) when the measured profile moved from the one the deployed plan was made for:
    a rank link's one-way delay by more than ``rel_margin`` (of the larger value) + ``abs_margin_ms``,
    or a rank's period P_r = Σ over its stages of F + I + W (the unit of the virtual Eq.1) by more than
    ``compute_rel_margin`` + ``abs_margin_ms`` — in either direction: the portfolio re-picks by
    simulation, which also gives memory back when a straggler recovers.  Below the margins nothing
    changes, so jitter (of one stage's time on a loaded host, of a delay near a threshold) cannot flap
    the plan."""

    compute_rel_margin: float = 0.25
    layout: Layout | None = None  # set by the schedule
    _reference: PipelineProfile | None = field(default=None, init=False, repr=False)

    def moved(self, old: float, new: float, rel: float) -> bool:
        return abs(new - old) > rel * max(old, new) + self.abs_margin_ms

    def changes(self, ref: PipelineProfile, estimate: PipelineProfile) -> list[str]:
        """What moved beyond the margins between two stage-level profiles (empty: nothing)."""
        layout = self.layout
        links = [layout.boundary_link(s) for s in range(estimate.num_stages - 1)]
        out = [f"rank link {lk}: c {a:.1f} -> {b:.1f} ms"
               for lk, a, b in sorted({(lk, a, b) for lk, a, b in zip(links, ref.delays_ms, estimate.delays_ms)
                                       if lk is not None})
               if self.moved(a, b, self.rel_margin)]
        periods = [rank_periods_ms(p, layout.stage_to_rank, with_w=True) for p in (ref, estimate)]
        out += [f"rank {r}: period {a:.1f} -> {b:.1f} ms" for r, (a, b) in enumerate(zip(*periods))
                if self.moved(a, b, self.compute_rel_margin)]
        return out

    def decide(self, estimate: PipelineProfile, deployed_counts: Sequence[int], initial_counts: Sequence[int],
               iterations_since_deploy: int, slack_floor: int = 2) -> Decision:  # noqa: ARG002 - protocol
        if self._reference is None:
            self._reference = estimate
            return Decision("keep", "first measurement")
        what = self.changes(self._reference, estimate)
        if not what:
            return Decision("keep", "profile within the margins of the deployed plan's")
        self._reference = estimate
        return Decision("adapt", "; ".join(what), mode="adaptive")


def virtual_tolerances(estimate: PipelineProfile, layout: Layout, warmup_counts: Sequence[int]) -> list[float]:
    """Per rank link, the largest one-way delay the plan's warm-up counts absorb by the virtual Eq.1
    (``plan.virtual.virtual_link_tolerance_ms``; a sufficient condition, docs/multistage.md)."""
    return [virtual_link_tolerance_ms(estimate, layout.stage_to_rank, warmup_counts, link)
            for link in range(layout.num_ranks - 1)]
