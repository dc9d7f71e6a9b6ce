"""The memory budget of one adaptive schedule: x_max of the initial plan and the caps of later plans
(PipeMorph §4.2 Alg.1's M; the rules themselves are ``runtime/execute/memory.py``'s).

:class:`StageMemoryBudget` (one stage per rank) caps in-flight activations per stage;
:class:`RankMemoryBudget` (several stages per rank) keeps a per-rank cap K_r that the
multi-stage planner splits among the rank's stages.  The factory (``runtime/control/parts.py``) picks one.
Every rank absorbs the same exchanged numbers, so every rank computes the same caps.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable, Sequence

from titan_ext.plan.ir import as_ops
from titan_ext.plan.result import peak_inflight, peak_memory_per_rank

from ..execute.memory import PENDING, RELEASE, activation_budget_bytes, inflight_cap, rank_memory_limits, stage_caps

__all__ = ["MemoryBudget", "RankMemoryBudget", "StageMemoryBudget"]

#: the schedule's logger: a budget warning is the schedule's (users and tests filter on that name)
logger = logging.getLogger("titan_ext.runtime.adaptive")


class MemoryBudget:
    """x_max (Alg.1) from ``max_inflight``, else the budget over measured M^F, else 2S − 1; the measured
    cap ``inflight_cap`` of later plans, and the configured ``adaptive_memory_limit`` on top."""

    def __init__(self, name: str, num_stages: int, n_microbatches: int, stages_per_rank: int,
                 budget_bytes: float | None, max_inflight: int | None, adaptive_memory_limit: int | None,
                 device: Callable[[], Any], local_activation_bytes: Callable[[], float | None]):
        self.name, self.S, self.N, self.V = name, num_stages, n_microbatches, stages_per_rank
        self.budget_bytes, self.max_inflight = budget_bytes, max_inflight
        self.adaptive_memory_limit = adaptive_memory_limit
        self.device, self._local_act = device, local_activation_bytes
        self.inflight_cap: int | None = None  # measured cap of adaptive plans (per stage)
        self.rank_memory_limit: tuple[float, ...] | None = None  # several stages per rank: K_r
        self.activation_bytes_all: list[float] | None = None
        self._warned = False
        self.x_max = self.initial_x_max()

    def initial_x_max(self) -> int:
        """Alg.1's x_max within [S, N]: until M^F is measured (first forward) a budget holds 1F1B's
        memory (x_max = S), which fits any budget that 1F1B fits."""
        S, N = self.S, self.N
        if self.max_inflight is not None:
            x = self.max_inflight
        elif self.budget_bytes is not None:
            act = self._local_act()
            if self.activation_bytes_all is not None:  # stage 0's own (one stage per rank), else the largest
                act = self._x_max_activation(self.activation_bytes_all)
            x = int(self.budget_bytes // act) if act else S
            if x < S:
                logger.warning("%s: budget %.3g B holds only %d activations of %.3g B (< S=%d); using S", self.name,
                               self.budget_bytes, x, act or 0, S)
                x = S
        else:
            x = 2 * S - 1
        return max(S, min(int(x), N))

    def _x_max_activation(self, activation_bytes_all: Sequence[float]) -> float:
        """The activation x_max counts: stage 0's own (one stage per rank); the largest with several."""
        return max(activation_bytes_all)

    def recalibrate(self) -> bool:
        """Recompute x_max from measured M^F (a configured budget without ``max_inflight``); True if so."""
        if self.budget_bytes is None or self.max_inflight is not None:
            return False
        self.x_max = self.initial_x_max()
        return True

    def local_budget_bytes(self) -> float:
        """This rank's contribution to the profile exchange (``memory.activation_budget_bytes``)."""
        return activation_budget_bytes(self.device(), self.budget_bytes)

    def absorb(self, budgets: Sequence[float], activation_bytes: Sequence[float], rank: int) -> None:
        """The exchanged budgets and M^F of every rank → the caps."""
        self.activation_bytes_all = list(activation_bytes)
        self._set_caps(list(budgets))
        self._warn_small_budget(budgets, rank)

    def _set_caps(self, budgets: list[float]) -> None:
        self.rank_memory_limit = None
        self.inflight_cap = inflight_cap(budgets, self.activation_bytes_all, self.N, pending_cap=self.x_max)

    def adaptive_limit(self, lifted: bool = False) -> int | None:
        """Cap on in-flight activations of adaptive plans: the measured cap and ``adaptive_memory_limit``
        (the latter ``lifted`` while delegating, §5.2)."""
        limits = [self.inflight_cap] + ([] if lifted else [self.adaptive_memory_limit])
        limits = [x for x in limits if x is not None]
        return min(limits) if limits else None

    def capped(self, profile: Any, lifted: bool = False) -> Any:  # noqa: ARG002
        """The profile the policy reads: a per-rank cap K_r bounds the plan (``rank_memory_limit``), not
        the profile (:class:`StageMemoryBudget` caps it per stage)."""
        return profile

    def planning_x_max(self) -> int:
        return self.x_max if self.inflight_cap is None else max(1, min(self.x_max, self.inflight_cap))

    def over_cap(self, kind: str, peak_inflight: int, actions: Any, lifted: bool = False) -> str:
        """Why a planner-made candidate no longer fits the *current* cap (empty: it fits).  A background
        candidate was planned under the cap of the boundary that started it; the cap is re-read at every
        exchange (free memory shrinks, e.g. once AdamW's state exists), so it is checked again before the
        swap."""
        if kind not in ("initial", "adaptive"):
            return ""
        limit = self.adaptive_limit(lifted) if kind == "adaptive" else self.inflight_cap
        if limit is None or peak_inflight <= limit:
            return ""
        return (f"holds {peak_inflight} in-flight activations on a stage, above the current memory cap "
                f"of {limit} (the cap shrank while it was planned)")

    def _warn_small_budget(self, budgets: Sequence[float], rank: int) -> None:
        """Once, from PP rank 0: a budget that holds fewer activations than stages (below 1F1B's memory,
        e.g. ``memory_budget_gib = 1e-9``) is applied, but said."""
        S = self.S
        caps = getattr(self, "stage_caps", None) or ([self.inflight_cap] * S if self.inflight_cap is not None else None)
        if caps is None or all(c >= S - s for s, c in enumerate(caps)) or self._warned:
            return
        self._warned = True
        if rank == 0:
            logger.warning("PipeMorph: the memory budget (%s B per rank) holds %s in-flight activations per stage "
                           "(of %s B each), less than 1F1B holds (%s): plans are capped there and will be slow; "
                           "raise [titan_ext] memory_budget_gib (0 = no budget)",
                           ", ".join(f"{b:.3g}" for b in budgets), list(caps),
                           ", ".join(f"{a:.3g}" for a in self.activation_bytes_all), [S - s for s in range(S)])


class StageMemoryBudget(MemoryBudget):
    """One stage per rank: the caps count activations of a stage, each stage its own rank's
    (``memory.stage_caps``: budget_r / M^F_r); ``inflight_cap`` is the smallest (metrics, warnings)."""

    stage_caps: list[int] | None = None

    def _x_max_activation(self, activation_bytes_all: Sequence[float]) -> float:
        return activation_bytes_all[0]

    def _set_caps(self, budgets: list[float]) -> None:
        super()._set_caps(budgets)
        self.stage_caps = stage_caps(budgets, self.activation_bytes_all, self.N)

    def adaptive_limit(self, lifted: bool = False) -> int | list[int] | None:
        """Per stage once the caps are known (each within ``adaptive_memory_limit`` unless ``lifted``)."""
        if self.stage_caps is None:
            return super().adaptive_limit(lifted)
        user = None if lifted else self.adaptive_memory_limit
        return [c if user is None else min(c, user) for c in self.stage_caps]

    def capped(self, profile: Any, lifted: bool = False) -> Any:
        """``profile`` carrying the adaptive plans' per-stage caps as its memory (in activations:
        ``activation_bytes`` 1, ``memory_budget_bytes`` the cap), so the policy's Alg.2 target and the
        planners see the same limit (``PipelineProfile.max_inflight``); unchanged without a cap."""
        limit = self.adaptive_limit(lifted)
        if limit is None:
            return profile
        caps = limit if isinstance(limit, list) else [limit] * profile.num_stages
        return replace(profile, activation_bytes=(1.0,) * profile.num_stages,
                       memory_budget_bytes=tuple(float(c) for c in caps))

    def planning_x_max(self) -> int | list[int]:
        """Alg.1's bound: x_max on stage 0, each other stage its own cap."""
        if self.stage_caps is None:
            return super().planning_x_max()
        return [max(1, min(self.x_max, self.stage_caps[0]))] + list(self.stage_caps[1:])

    def over_cap(self, kind: str, peak_inflight_: int, actions: Any, lifted: bool = False) -> str:
        if kind not in ("initial", "adaptive") or self.stage_caps is None:
            return super().over_cap(kind, peak_inflight_, actions, lifted)
        limit = self.adaptive_limit(lifted) if kind == "adaptive" else self.stage_caps
        over = {s: p for s, p in peak_inflight(as_ops(actions), RELEASE).items() if p > limit[s]}
        if not over:
            return ""
        return (f"holds {max(over.values())} in-flight activations on stage {max(over, key=over.get)}, above the "
                f"current memory cap of {list(limit)} per stage (the cap shrank while it was planned)")


class RankMemoryBudget(MemoryBudget):
    """Several stages per rank: a per-rank cap K_r (``memory.rank_memory_limits``) once every device
    budget is known; before that, the initial regime's cap in the planners' unit (x_max // V)."""

    def _set_caps(self, budgets: list[float]) -> None:
        if PENDING not in budgets:  # per rank; the planner splits it by need
            self.rank_memory_limit = rank_memory_limits(budgets, self.activation_bytes_all, self.V, self.N)
            self.inflight_cap = None
            return
        super()._set_caps(budgets)
        if self.inflight_cap is not None:
            self.inflight_cap = max(1, self.inflight_cap // self.V)

    def over_cap(self, kind: str, peak_inflight: int, actions: Any, lifted: bool = False) -> str:
        if kind not in ("initial", "adaptive") or self.rank_memory_limit is None:
            return super().over_cap(kind, peak_inflight, actions, lifted)
        peaks = peak_memory_per_rank(actions, release=RELEASE)
        over = {r: p for r, p in peaks.items() if p > self.rank_memory_limit[r] + 1e-9}
        if not over:
            return ""
        return (f"holds {max(over.values()):g} activations on rank {max(over, key=over.get)}, above the current "
                f"per-rank cap {list(self.rank_memory_limit)}")
