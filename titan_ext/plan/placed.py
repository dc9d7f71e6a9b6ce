"""A stage-level :class:`~titan_ext.plan.profile.PipelineProfile` on a placement, with a per-rank memory
limit: the one description CrossPipe's planners (greedy, local search, portfolio, polish, the CP-SAT
solver and the compiled ``_greedy.c`` / ``_search.c``) read — CrossPipe §3.2/§4.2's inputs T_F, T_D, T_W
per stage, the α-β links, the stage → rank map and M_L.

* times: the profile's, read in integer nanoseconds (``timing.to_ns``; :meth:`PlacedProfile.times_ns`,
  :meth:`PlacedProfile.link_ns`), the unit of every evaluator of plan/;
* placement: ``plan.placement``'s model (stage s on rank ``stage_to_rank[s]``; the boundary s → s+1 uses
  ``profile.links[s]``, free when both stages sit on one rank; a message's queue is its rank direction,
  :meth:`PlacedProfile.channel`, as ``simulate`` sends it);
* memory: the profile's rule (``profile.release``, ``plan.profile.RELEASES``) as per-operation deltas in
  activation units (:data:`MEMORY_DELTAS`) and a per-rank limit on the activations held.

Validated once (the profile by :class:`PipelineProfile` itself, the placement by ``plan.placement``);
frozen.  Pure: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..args import ArgumentTypeError
from .deps import KINDS
from .placement import _s2r_arg
from .profile import PipelineProfile, profile_arg
from .timing import to_ns

__all__ = ["MEMORY_DELTAS", "PlacedProfile"]

MEMORY_DELTAS = {"I": (1, -1, 0), "W": (1, 0, -1)}
"""``profile.release`` → the net memory change (M_F, M_D, M_W) of one F / I / W in activation units
(CrossPipe §4.2's inputs): the same rule as ``profile.RELEASES`` ("I": an activation freed at its I,
"W": held until its W)."""


@dataclass(frozen=True)
class PlacedProfile:
    """A stage-level profile, where each stage runs, and how many activations a rank may hold."""

    profile: PipelineProfile
    """stage-level: one entry per stage; ``links[s]`` joins stage s and s + 1."""
    stage_to_rank: tuple[int, ...]
    """rank of each stage (``plan.placement``); stages on different ranks must sit on adjacent ranks."""
    memory_limit: tuple[float, ...] | None = None
    """per-rank limit M_L on the activations held (in activation units; None: unlimited)."""
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        profile_arg(self.profile)
        s2r = _s2r_arg(self.stage_to_rank, "stage_to_rank")
        object.__setattr__(self, "stage_to_rank", s2r)
        if len(s2r) != self.profile.num_stages:
            raise ValueError(f"stage_to_rank maps {len(s2r)} stages; the profile has {self.profile.num_stages}")
        for s in range(len(s2r) - 1):
            a, b = s2r[s], s2r[s + 1]
            if abs(a - b) > 1:
                raise ValueError(f"stage_to_rank: stages {s} and {s + 1} sit on ranks {a} and {b}, which share no link")
        self._check_memory_limit()

    def _check_memory_limit(self) -> None:
        limit = self.memory_limit
        if limit is None:
            return
        if isinstance(limit, (str, bytes)) or not isinstance(limit, Sequence):
            raise ArgumentTypeError(f"memory_limit must be one number per rank or None, got {type(limit).__name__}")
        limit = tuple(float(x) for x in limit)
        object.__setattr__(self, "memory_limit", limit)
        R, mf = self.num_ranks, self.memory_deltas[0]
        if len(limit) != R:
            raise ValueError(f"memory_limit must have one value per rank ({R}), got {len(limit)}")
        for r, lim in enumerate(limit):
            need = mf * self.stage_to_rank.count(r)
            if not (lim >= need - 1e-9):
                raise ValueError(f"memory_limit[{r}] = {lim} is below one microbatch per stage on that rank ({need})")

    @classmethod
    def of(cls, profile: PipelineProfile, stage_to_rank: Sequence[int],
           memory_limit: float | Sequence[float] | None = None) -> "PlacedProfile":
        """``profile`` on ``stage_to_rank`` with ``memory_limit``: one number for every rank, one per rank,
        or None — the profile's memory budget (``max_inflight()``, summed over a rank's stages), unlimited
        when it has none."""
        profile_arg(profile)
        s2r = _s2r_arg(stage_to_rank, "stage_to_rank")
        R = max(s2r) + 1
        if memory_limit is None:
            per_stage = profile.max_inflight() if profile.num_stages == len(s2r) else None
            if per_stage is not None:
                memory_limit = [float(sum(per_stage[s] for s in range(len(s2r)) if s2r[s] == r)) for r in range(R)]
        elif isinstance(memory_limit, (int, float)) and not isinstance(memory_limit, bool):
            memory_limit = [float(memory_limit)] * R
        return cls(profile, s2r, None if memory_limit is None else tuple(memory_limit))

    # ------------------------------------------------------------------ read-offs
    @property
    def num_stages(self) -> int:
        return self.profile.num_stages

    @property
    def num_microbatches(self) -> int:
        return self.profile.num_microbatches

    @property
    def num_ranks(self) -> int:
        return max(self.stage_to_rank) + 1

    @property
    def release(self) -> str:
        return self.profile.release

    @property
    def memory_deltas(self) -> tuple[int, int, int]:
        """(M_F, M_D, M_W) of the profile's memory rule (:data:`MEMORY_DELTAS`)."""
        return MEMORY_DELTAS[self.profile.release]

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def times_ns(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """Per-stage F, I (the paper's D) and W times in integer ns (``timing.to_ns``)."""
        out = self._cache.get("times")
        if out is None:
            p = self.profile
            out = tuple(tuple(to_ns(x) for x in v) for v in (p.f_ms, p.b_ms, p.w_ms))
            self._cache["times"] = out
        return out

    def link_ns(self, boundary: int) -> tuple[int, int]:
        """(α, size·β) of stage boundary ``boundary`` in ns (0, 0 without links)."""
        links = self.profile.links
        if not links:
            return 0, 0
        link = links[boundary]
        return to_ns(link.latency_ms), to_ns(link.transfer_ms)

    def channel(self, src_stage: int, dst_stage: int) -> tuple[int, tuple[int, int]] | None:
        """(boundary, (src rank, dst rank)) of the message from ``src_stage`` to the adjacent ``dst_stage``:
        the link it crosses and its queue (one message at a time per rank direction, §4.2.3); None when
        both stages sit on one rank (available as soon as the producer ends)."""
        a, b = self.stage_to_rank[src_stage], self.stage_to_rank[dst_stage]
        if a == b:
            return None
        return min(src_stage, dst_stage), (a, b)

    def per_stage_limit(self) -> list[int] | None:
        """One stage per rank: the per-rank limit as whole in-flight activations per stage (the validator's
        ``inflight_limit``); None when unlimited or when a rank holds several stages."""
        if self.memory_limit is None or len(self.stage_to_rank) != self.num_ranks:
            return None
        return [int(math.floor(x + 1e-9)) for x in self.memory_limit]

    def peak_memory(self, orders: Mapping[int, Sequence]) -> list[float]:
        """Peak memory per rank (activation units, :attr:`memory_deltas`) over each rank's program order."""
        delta = dict(zip(KINDS, self.memory_deltas))
        delta["B"] = self.memory_deltas[1] + self.memory_deltas[2]
        peaks = []
        for r in range(self.num_ranks):
            cur = peak = 0
            for op in orders.get(r, ()):
                cur += delta[op[1]]
                peak = max(peak, cur)
            peaks.append(float(peak))
        return peaks

    def check_orders(self, orders: Mapping[int, Sequence]) -> None:
        """A plan of this profile (rank → ``(stage, kind, microbatch)`` ops) is complete
        (``plan.complete.check_complete``: every operation once), splits its backwards (F, I, W: the
        kinds CrossPipe plans) and runs every operation on its stage's rank; ``PlanValidationError``
        (a ValueError) naming the first fault otherwise."""
        from .complete import PlanValidationError, check_complete

        ops = {r: list(o) for r, o in orders.items()}
        check_complete(ops, self.num_stages, self.num_microbatches)
        for r, rank_ops in ops.items():
            for s, k, m in rank_ops:
                if k == "B":
                    raise PlanValidationError(f"action {s}{k}{m}: a full backward (CrossPipe plans I and W)")
                if self.stage_to_rank[s] != r:
                    raise PlanValidationError(f"action {s}{k}{m} is on rank {r}, but stage {s} sits on rank "
                                              f"{self.stage_to_rank[s]}")

    def with_memory_limit(self, memory_limit: Sequence[float] | None) -> "PlacedProfile":
        """The same profile and placement under another memory limit (only the limit is checked again:
        the planner derives dozens of these per plan)."""
        new = object.__new__(PlacedProfile)
        object.__setattr__(new, "profile", self.profile)
        object.__setattr__(new, "stage_to_rank", self.stage_to_rank)
        object.__setattr__(new, "memory_limit", None if memory_limit is None else tuple(memory_limit))
        object.__setattr__(new, "_cache", self._cache)  # same times, links and placement
        new._check_memory_limit()
        return new
