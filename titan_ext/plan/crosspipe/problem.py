"""The CrossPipe planning problem (CrossPipe §3.2, §4.2 inputs) and the plain-tuple plan helpers.

Bottom of the ``crosspipe`` package: imports nothing of it.  Operations are plain tuples
``(stage, kind, microbatch)`` inside plan/; torch's ``_Action`` only at the boundary (:func:`to_actions`
through ``titan_ext.plan.ir``, imported lazily, so importing this module imports no torch).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

from ..ir import COMPUTE_KINDS, Op
from ..placement import stage_profile, stage_to_rank

CROSSPIPE_VARIANTS = ("ud", "udsub", "wave")

KINDS = COMPUTE_KINDS[:3]
"""the kinds CrossPipe schedules, in operation-id order: 0 F, 1 I (the paper's D), 2 W."""
F, I, W = KINDS


class Hop(NamedTuple):
    """The message from one stage to an adjacent stage on another rank."""

    boundary: int
    """stage boundary crossed (link ``i`` joins stage ``i`` and ``i + 1``)."""
    channel: tuple[int, int]
    """(src rank, dst rank): one message at a time per channel (§4.2.3)."""
    transfer_ms: float
    """size·β: how long the message occupies the channel."""
    latency_ms: float
    """α: pipelined latency (does not occupy the channel)."""


def wave_stage_to_rank(num_ranks: int) -> tuple[int, ...]:
    """V-shape placement used by CrossWave and torch's ZBV: stages s and 2R−1−s on rank s
    (``plan.placement.stage_to_rank(R, 2, "v")``)."""
    return stage_to_rank(num_ranks, 2, "v")


@dataclass(frozen=True)
class CrossPipeProblem:
    """Everything the CrossPipe generators and the optimal solver need (CrossPipe §3.2, §4.2 inputs).

    Stages are model chunks in data-flow order (``num_stages`` = len(stage_to_rank)); ranks are
    devices.  As in :class:`titan_ext.plan.PipelineProfile`, link ``i`` is the boundary between stage
    ``i`` and ``i + 1`` (unused when both sit on one rank), with latency ``link_latency_ms[i]`` (α) and
    per-message transfer time ``link_transfer_ms[i]`` (size·β).  Each direction between two ranks
    (channel ``(src rank, dst rank)``) carries one message at a time — for CrossWave, boundaries
    ``r`` and ``2R−2−r`` share the ranks ``r``/``r+1`` and so share their channels.
    """

    num_ranks: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    f_ms: tuple[float, ...]
    """forward time per stage (T_F)."""
    b_ms: tuple[float, ...]
    """backward-input time per stage (T_D in CrossPipe, torch's I)."""
    w_ms: tuple[float, ...]
    """backward-weight time per stage (T_W)."""
    link_latency_ms: tuple[float, ...] = ()
    """one-way latency α per stage boundary (len num_stages − 1); empty = all zero."""
    link_transfer_ms: tuple[float, ...] = ()
    """bandwidth time size·β of one message per stage boundary (len num_stages − 1); empty = all zero."""
    memory_limit: tuple[float, ...] | None = None
    """per-rank memory limit M_L in activation units (None = unlimited)."""
    memory_deltas: tuple[float, float, float] = (1.0, -1.0, 0.0)
    """net memory change (M_F, M_D, M_W) of one F / I / W, in activation units."""

    def __post_init__(self) -> None:
        R, N = self.num_ranks, self.num_microbatches
        if not isinstance(R, int) or R < 1:
            raise ValueError(f"num_ranks must be a positive int, got {R!r}")
        if not isinstance(N, int) or N < 1:
            raise ValueError(f"num_microbatches must be a positive int, got {N!r}")
        S = len(self.stage_to_rank)
        if S < 1:
            raise ValueError("stage_to_rank must name at least one stage")
        if sorted(set(self.stage_to_rank)) != list(range(R)):
            raise ValueError(f"stage_to_rank must use every rank 0..{R - 1}: {self.stage_to_rank}")
        for s in range(S - 1):
            a, b = self.stage_to_rank[s], self.stage_to_rank[s + 1]
            if abs(a - b) > 1:
                raise ValueError(f"stage_to_rank: stages {s} and {s + 1} sit on ranks {a} and {b}, which share no link")
        for name in ("f_ms", "b_ms", "w_ms"):
            vals = getattr(self, name)
            if len(vals) != S:
                raise ValueError(f"{name} must have one value per stage ({S}), got {len(vals)}")
            for v in vals:
                if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                    raise ValueError(f"{name} must be finite and >= 0, got {v!r}")
        for name in ("link_latency_ms", "link_transfer_ms"):
            vals = getattr(self, name)
            if vals and len(vals) != S - 1:
                raise ValueError(f"{name} must have one value per stage boundary ({S - 1}), got {len(vals)}")
            for v in vals:
                if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                    raise ValueError(f"{name} must be finite and >= 0, got {v!r}")
        mf, mi, mw = self.memory_deltas
        if not (mf > 0 and mi <= 0 and mw <= 0 and abs(mf + mi + mw) < 1e-9):
            raise ValueError(f"memory_deltas must be (M_F > 0, M_D <= 0, M_W <= 0) summing to 0, got {self.memory_deltas}")
        self._check_memory_limit()

    def _check_memory_limit(self) -> None:
        R, mf = self.num_ranks, self.memory_deltas[0]
        if self.memory_limit is not None:
            if len(self.memory_limit) != R:
                raise ValueError(f"memory_limit must have one value per rank ({R}), got {len(self.memory_limit)}")
            for r, lim in enumerate(self.memory_limit):
                need = mf * sum(1 for x in self.stage_to_rank if x == r)
                if not (lim >= need - 1e-9):
                    raise ValueError(
                        f"memory_limit[{r}] = {lim} is below one microbatch per stage on that rank ({need})"
                    )

    # ------------------------------------------------------------------ helpers
    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def latency(self, link: int) -> float:
        return self.link_latency_ms[link] if self.link_latency_ms else 0.0

    def transfer(self, link: int) -> float:
        return self.link_transfer_ms[link] if self.link_transfer_ms else 0.0

    def hop(self, src_stage: int, dst_stage: int) -> Hop | None:
        """The :class:`Hop` of data from src_stage to the adjacent dst_stage; None if both stages sit on
        the same rank (a same-rank dependency is available as soon as its producer ends)."""
        a, b = self.stage_to_rank[src_stage], self.stage_to_rank[dst_stage]
        if a == b:
            return None
        link = min(src_stage, dst_stage)
        return Hop(link, (a, b), self.transfer(link), self.latency(link))

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def with_memory_limit(self, memory_limit: Sequence[float] | None) -> "CrossPipeProblem":
        """This problem with another memory limit (only the limit is re-validated: the planner derives
        dozens of these per plan)."""
        new = object.__new__(CrossPipeProblem)
        for name in _PROBLEM_FIELDS:
            object.__setattr__(new, name, getattr(self, name))
        object.__setattr__(new, "memory_limit", None if memory_limit is None else tuple(float(x) for x in memory_limit))
        new._check_memory_limit()
        return new

    @classmethod
    def uniform(
        cls,
        num_ranks: int,
        num_microbatches: int,
        f_ms: float,
        b_ms: float,
        w_ms: float,
        *,
        wave: bool = False,
        latency_ms: Mapping[int, float] | float = 0.0,
        transfer_ms: Mapping[int, float] | float = 0.0,
        memory_limit: Sequence[float] | float | None = None,
    ) -> "CrossPipeProblem":
        """Uniform per-stage times; ``latency_ms``/``transfer_ms`` either one value for every link
        between ranks or ``{rank link: ms}`` (rank link ``i`` joins rank ``i`` and ``i + 1``).  With
        ``wave=True`` there are 2·num_ranks stages (V-shape, stages s and 2R−1−s on rank s)."""
        stage_to_rank = wave_stage_to_rank(num_ranks) if wave else tuple(range(num_ranks))
        S = len(stage_to_rank)

        def per_link(v):
            out = [0.0] * (S - 1)
            items = v.items() if isinstance(v, Mapping) else ((k, v) for k in range(num_ranks - 1))
            for k, x in items:
                if not 0 <= k < num_ranks - 1:
                    raise ValueError(f"link {k} out of range 0..{num_ranks - 2}")
                for s in range(S - 1):
                    if {stage_to_rank[s], stage_to_rank[s + 1]} == {k, k + 1}:
                        out[s] = float(x)
            return tuple(out)

        if memory_limit is not None and not isinstance(memory_limit, Sequence):
            memory_limit = [float(memory_limit)] * num_ranks
        return cls(
            num_ranks, num_microbatches, stage_to_rank, (float(f_ms),) * S, (float(b_ms),) * S,
            (float(w_ms),) * S, per_link(latency_ms), per_link(transfer_ms),
            None if memory_limit is None else tuple(float(x) for x in memory_limit),
        )


_PROBLEM_FIELDS = tuple(f.name for f in dataclasses.fields(CrossPipeProblem))


def peak_memory(problem: CrossPipeProblem, orders: Mapping[int, Sequence[Op]]) -> list[float]:
    """Peak memory per rank (activation units, ``memory_deltas``) over each rank's program order."""
    delta = dict(zip(KINDS, problem.memory_deltas))
    peaks = []
    for r in range(problem.num_ranks):
        cur = peak = 0.0
        for op in orders[r]:
            cur += delta[op[1]]
            peak = max(peak, cur)
        peaks.append(peak)
    return peaks


def to_actions(orders: Mapping[int, Sequence[Op]]) -> dict:
    """Plain tuples → torch IR ``dict[rank, list[_Action]]`` through the planning core's single
    conversion point (``titan_ext.plan.ir``, which imports torch lazily)."""
    from ..ir import to_torch_plan

    return to_torch_plan({r: list(ops) for r, ops in sorted(orders.items())})


# ----------------------------------------------------------------------------- profile boundary
def _profile_placement(num_stages: int, variant: str) -> tuple[int, ...]:
    if variant == "wave":
        if num_stages % 2:
            raise ValueError(f"crosspipe-wave needs an even number of stages (two chunks per rank), got {num_stages}")
        return wave_stage_to_rank(num_stages // 2)
    if variant in ("ud", "udsub"):
        return tuple(range(num_stages))
    raise ValueError(f"variant must be one of {CROSSPIPE_VARIANTS}, got {variant!r}")


def problem_from_profile(
    profile,
    variant: str = "ud",
    memory_limit: int | float | Sequence[float] | None = None,
    memory_deltas: tuple[float, float, float] | None = None,
) -> CrossPipeProblem:
    """Build the generator's problem from a :class:`titan_ext.plan.PipelineProfile`.
    ``memory_deltas``: (M_F, M_D, M_W) per activation; None: the profile's ``release`` rule,
    (1, −1, 0) for "I" and (1, 0, −1) for "W" (``profile.RELEASES``).

    ``variant`` "ud"/"udsub": one stage per rank.  "wave": the profile describes the 2R model chunks
    (``num_stages`` even), placed V-shape (stages s and 2R−1−s on rank s, as torch's ZBV).
    ``memory_limit``: per-rank limit on in-flight activations (one number for all ranks or one per
    rank); None → the profile's memory budget (``max_inflight()``, summed over a rank's stages) or
    unlimited when the profile has none.
    """
    from ..profile import profile_arg

    S = profile_arg(profile).num_stages
    stage_to_rank = _profile_placement(S, variant)
    R = max(stage_to_rank) + 1
    if memory_limit is None:
        per_stage = profile.max_inflight()
        if per_stage is not None:
            memory_limit = [float(sum(per_stage[s] for s in range(S) if stage_to_rank[s] == r)) for r in range(R)]
    elif isinstance(memory_limit, (int, float)):
        memory_limit = [float(memory_limit)] * R
    return CrossPipeProblem(
        num_ranks=R,
        num_microbatches=profile.num_microbatches,
        stage_to_rank=stage_to_rank,
        f_ms=tuple(profile.f_ms),
        b_ms=tuple(profile.b_ms),
        w_ms=tuple(profile.w_ms),
        link_latency_ms=tuple(link.latency_ms for link in profile.links),
        link_transfer_ms=tuple(link.transfer_ms for link in profile.links),
        memory_limit=None if memory_limit is None else tuple(float(x) for x in memory_limit),
        memory_deltas=memory_deltas if memory_deltas is not None else MEMORY_DELTAS[profile.release],
    )


MEMORY_DELTAS = {"I": (1.0, -1.0, 0.0), "W": (1.0, 0.0, -1.0)}
"""``profile.release`` → CrossPipe's per-op memory deltas (M_F, M_D, M_W): the same rule as ``profile.RELEASES``."""


def wave_profile(profile):
    """The V-shape (CrossWave / ZBV) version of a one-stage-per-rank profile: each rank's stage is cut
    into two chunks of half its F/B/W time (and activation size), chunk s and 2R−1−s on rank s; the
    link between rank i and i+1 (``profile.links[i]``) carries both stage boundaries that cross it
    (``plan.placement.stage_profile``)."""
    return stage_profile(profile, wave_stage_to_rank(profile.num_stages))
