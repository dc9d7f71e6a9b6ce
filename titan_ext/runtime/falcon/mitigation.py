"""Falcon-Mitigate planning (Falcon §5), free of process groups.

* :class:`MitigationPlanner` — Alg. 1, adaptive multi-level mitigation (ski-rental, §5.2).
* :func:`min_max_microbatch_split` — Eq. (1), integer micro-batch split across DP groups (§5.3).
* :func:`plan_topology` — topology adjustment (§5.3, Fig. 10/11; PipeMorph §6, §7.3): a permutation
  of the DP × PP device grid that moves slow links off DP groups onto PP hops and consolidates
  stragglers into the fewest, preferably interior, PP stages.

Functions here *plan*; applying a plan (re-planning the PP schedule, re-weighting gradients,
checkpoint-and-restart with a permuted mesh) is the caller's (see ``redistribute.py``,
``restart.py``, ``monitor.py``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from titan_ext.args import (
    ArgumentTypeError,
    choice_arg,
    counts_arg,
    instance_arg,
    int_arg,
    real_arg,
    reals_arg,
    sequence_arg,
)

__all__ = [
    "ROOT_CAUSES",
    "STRATEGIES",
    "StrategyCosts",
    "strategies_for",
    "MitigationPlanner",
    "min_max_microbatch_split",
    "predicted_iteration_s",
    "TopologyPlan",
    "plan_topology",
    "topology_score",
]

ROOT_CAUSES = ("pp_link", "dp_link", "compute", "unknown")
"""pp_link: a slow link on a PP hop; dp_link: a slow link inside a DP group; compute: a slow device."""

STRATEGIES = (
    "ignore",
    "pipemorph_replan",
    "microbatch_redistribution",
    "topology_adjustment",
    "checkpoint_restart",
)


@dataclass(frozen=True)
class StrategyCosts:
    """One-off overhead (seconds of lost training time) of each strategy (Falcon Table 3)."""

    ignore: float = 0.0
    """S1: nothing to do."""
    pipemorph_replan: float = 1.0
    """PipeMorph re-plan (Alg. 2/3) + schedule swap at the iteration boundary (+ delegation)."""
    microbatch_redistribution: float = 3.0
    """S2: solve Eq. (1) and re-weight gradients ("a few seconds", Falcon §5.3)."""
    topology_adjustment: float = 60.0
    """S3: pause, dump, swap, restore ("typically within one minute", Falcon §5.3)."""
    checkpoint_restart: float = 600.0
    """S4: full checkpoint-and-restart on healthy nodes."""

    def __post_init__(self) -> None:
        for name in STRATEGIES:  # seconds >= 0; inf: never worth it
            real_arg(getattr(self, name), f"StrategyCosts.{name}", minimum=0, allow_inf=True)

    def of(self, strategy: str) -> float:
        return float(getattr(self, choice_arg(strategy, "strategy", STRATEGIES)))


def strategies_for(root_cause: str) -> list[str]:
    """FindStrategies(event.root_cause) of Alg. 1, before sorting by overhead.

    Effectiveness follows Falcon Table 3 and PipeMorph §6: a slow PP link is handled by re-planning
    the pipeline (the monitor adds CPU delegation to that decision when available); a slow DP link by
    moving it onto a PP hop (topology), after which the residual PP straggler is PipeMorph's; a slow
    device by micro-batch redistribution, then straggler consolidation.
    """
    replan = "pipemorph_replan"
    table = {
        "pp_link": ["ignore", replan, "topology_adjustment", "checkpoint_restart"],
        "dp_link": ["ignore", "topology_adjustment", "checkpoint_restart"],
        "compute": ["ignore", "microbatch_redistribution", "topology_adjustment", "checkpoint_restart"],
        "unknown": ["ignore", "checkpoint_restart"],
    }
    if not isinstance(root_cause, str) or root_cause not in table:
        raise ValueError(f"root_cause must be one of {ROOT_CAUSES}, got {root_cause!r}")
    return list(table[root_cause])


@dataclass
class MitigationPlanner:
    """Falcon Alg. 1 (adaptive multi-level fail-slow mitigation, ski-rental §5.2).

    ``start(root_cause, healthy_iteration_s)`` opens an event; then ``step(iteration_time_s)`` once
    per slow iteration returns the strategies to apply *now* (usually none). The accumulated impact is
    ``sum over slow iterations of (t_i - t_healthy)`` — Alg. 1's ``slow_iters * (t_slow - t_healthy)``
    when ``t_slow`` is constant, and the right ski-rental "rent paid" when a mitigation changes
    ``t_slow``. Strategy ``candidates[id]`` is applied when the impact reaches its overhead, then
    ``id`` advances. ``stop()`` closes the event (relief detected).
    """

    costs: StrategyCosts = field(default_factory=StrategyCosts)

    def __post_init__(self):
        instance_arg(self.costs, "costs", StrategyCosts)
        self.active = False
        self.candidates: list[str] = []
        self.next_id = 0
        self.slow_iters = 0
        self.impact_s = 0.0
        self.healthy_s = 0.0
        self.applied: list[tuple[int, str, float]] = []  # (slow_iter, strategy, impact at switch)

    def start(self, root_cause: str, healthy_iteration_s: float,
              slow_times_so_far: Sequence[float] = ()) -> None:
        """Open an event. ``slow_times_so_far``: iteration times since the onset that were observed
        before the root cause was known (they count as slow iterations and impact; Alg. 1 line 10)."""
        cands = strategies_for(root_cause)
        healthy_iteration_s = real_arg(healthy_iteration_s, "healthy_iteration_s", positive=True)
        slow_times_so_far = reals_arg(slow_times_so_far, "slow_times_so_far", positive=True)
        cands.sort(key=self.costs.of)  # Alg. 1 line 6 (stable: ties keep effectiveness order)
        self.candidates, self.next_id = cands, 0
        self.active, self.slow_iters, self.impact_s = True, 0, 0.0
        self.healthy_s = float(healthy_iteration_s)
        self.root_cause = root_cause
        self.applied = []
        for t in slow_times_so_far:
            self.slow_iters += 1
            self.impact_s += max(0.0, float(t) - self.healthy_s)

    def step(self, iteration_time_s: float) -> list[str]:
        real_arg(iteration_time_s, "iteration_time_s", positive=True)
        if not self.active:
            return []
        self.slow_iters += 1
        self.impact_s += max(0.0, float(iteration_time_s) - self.healthy_s)
        out = []
        # Alg. 1 lines 14-17 (a while-loop so that equal overheads switch in the same iteration).
        while self.next_id < len(self.candidates) and self.impact_s >= self.costs.of(
            self.candidates[self.next_id]
        ):
            s = self.candidates[self.next_id]
            out.append(s)
            self.applied.append((self.slow_iters, s, self.impact_s))
            self.next_id += 1
        return out

    def stop(self) -> None:
        self.active = False

    @property
    def next_strategy(self) -> str | None:
        return self.candidates[self.next_id] if self.active and self.next_id < len(self.candidates) else None


def min_max_microbatch_split(total_microbatches: int, per_microbatch_s: Sequence[float],
                             min_per_group: int = 1) -> list[int]:
    """Falcon Eq. (1): integers ``m_i >= min_per_group`` with ``sum m_i = M`` minimising
    ``max_i m_i t_i``; among min-max optima the greedy picks the one with the smallest variance of
    ``m_i t_i`` it reaches (each next micro-batch goes to the group that would finish it earliest).

    Greedy water-filling is exact for the min-max objective: after the forced ``min_per_group``, the
    k-th extra micro-batch is placed where ``(m_i + 1) t_i`` is smallest, and the final maximum equals
    the (M - D·min)-th smallest "completion time" over all groups, which is a lower bound for any split.
    (The paper solves a QP with cvxpy; for integers the greedy needs no solver and runs in
    O(M log D).)
    """
    total_microbatches = int_arg(total_microbatches, "total_microbatches", 1)
    min_per_group = int_arg(min_per_group, "min_per_group", 0)
    t = reals_arg(_listed(per_microbatch_s), "per_microbatch_s", positive=True)
    d = len(t)
    if d == 0:
        raise ValueError("per_microbatch_s is empty")
    if total_microbatches < d * min_per_group:
        raise ValueError(
            f"total_microbatches={total_microbatches} < {d} groups x min_per_group={min_per_group}"
        )
    import heapq

    m = [min_per_group] * d
    heap = [((m[i] + 1) * t[i], i) for i in range(d)]
    heapq.heapify(heap)
    for _ in range(total_microbatches - d * min_per_group):
        _, i = heapq.heappop(heap)
        m[i] += 1
        heapq.heappush(heap, ((m[i] + 1) * t[i], i))
    return m


def predicted_iteration_s(iteration_s: float, split: Sequence[int], per_replica_s: Sequence[float],
                          new_split: Sequence[int]) -> float:
    """The iteration time with ``new_split`` chunks per DP replica (0: the replica is gone, as
    after S4), from one measured at ``split`` with times per chunk ``per_replica_s``: the step's
    time outside its replicas' compute phases (``iteration_s`` − max ``m_i t_i``) stays, and each
    replica runs its new chunks at its measured time per chunk. Not in the paper, whose ski rental
    takes a strategy to end the slowdown; S4 without spare nodes drops whole replicas, and the kept
    ones take their chunks."""
    real_arg(iteration_s, "iteration_s", minimum=0)
    per_replica_s = reals_arg(_listed(per_replica_s), "per_replica_s", minimum=0)
    if not per_replica_s:
        raise ValueError("per_replica_s is empty")
    for name, value in (("split", split), ("new_split", new_split)):
        counts_arg(_listed(value), name, len(per_replica_s), minimum=0)
    busy = max(int(m) * float(t) for m, t in zip(split, per_replica_s))
    return max(0.0, float(iteration_s) - busy) + max(int(m) * float(t) for m, t in zip(new_split, per_replica_s))


# --------------------------------------------------------------------------------------------------
# Topology adjustment
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TopologyPlan:
    """A permutation of the device grid.

    ``grid[dp][pp]`` is the device (old global rank) that takes role (dp replica, pp stage). DP
    group of stage s = column s; the pipeline of replica d = row d, its hop h joins stages h, h+1.
    """

    grid: tuple[tuple[int, ...], ...]
    old_grid: tuple[tuple[int, ...], ...]
    score: tuple
    moved: int

    def role_of(self, device: int) -> tuple[int, int]:
        for d, row in enumerate(self.grid):
            if device in row:
                return d, row.index(device)
        raise KeyError(device)

    def as_dict(self) -> dict:
        return {"grid": [list(r) for r in self.grid], "moved": self.moved, "score": list(self.score)}


def _listed(value):
    """A 1-D numpy array as the list it holds (the checks take sequences; numpy is welcome)."""
    return value.tolist() if isinstance(value, np.ndarray) else value


def grid_arg(grid, name: str = "grid") -> list[list[int]]:
    """``grid[dp][pp]`` = global rank: a non-empty rectangle of distinct integers >= 0 (the one check of
    a device grid: :class:`~.monitor.FalconMonitor`, :func:`plan_topology`, :func:`topology_score`)."""
    rows = sequence_arg(_listed(grid), name, "a sequence of rows (grid[dp][pp] = global rank)")
    if not rows:
        raise ValueError(f"{name} is empty: at least one DP row of PP ranks")
    out = [counts_arg(_listed(row), f"{name}[{d}]", minimum=0) for d, row in enumerate(rows)]
    if not out[0] or any(len(row) != len(out[0]) for row in out):
        raise ValueError(f"{name} must be a rectangle of ranks (every row one per PP stage, at least one), "
                         f"got row lengths {[len(row) for row in out]}")
    seen = [r for row in out for r in row]
    if len(set(seen)) != len(seen):
        raise ValueError(f"{name} has repeated ranks: {out}")
    return out


def _links_arg(links, name: str, devices: set[int]) -> list[tuple[int, int]]:
    """Device pairs ``(a, b)`` of the grid (directed or not), a != b."""
    if isinstance(links, (str, bytes)) or not hasattr(links, "__iter__"):
        raise ArgumentTypeError(f"{name} must be an iterable of (rank, rank) pairs, got {type(links).__name__}")
    out = []
    for i, link in enumerate(links):
        a, b = counts_arg(_listed(link), f"{name}[{i}]", 2, minimum=0)
        if a not in devices or b not in devices or a == b:
            raise ValueError(f"{name}: slow link {(a, b)} is not a pair of distinct grid devices")
        out.append((a, b))
    return out


def _ranks_arg(ranks, name: str, devices: set[int]) -> list[int]:
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise ArgumentTypeError(f"{name} must be an iterable of ranks, got {type(ranks).__name__}")
    out = [int_arg(r, f"{name}[{i}]", 0) for i, r in enumerate(ranks)]
    for r in out:
        if r not in devices:
            raise ValueError(f"{name}: straggler {r} not in the grid")
    return out


def _positions(grid: np.ndarray) -> dict[int, tuple[int, int]]:
    return {int(grid[d, s]): (d, s) for d in range(grid.shape[0]) for s in range(grid.shape[1])}


def topology_score(grid, slow_links: Iterable[tuple[int, int]] = (),
                   stragglers: Iterable[int] = (), old_grid=None) -> tuple:
    """Lexicographic score (smaller is better) of a device grid:

    1. slow links not on a PP hop (a PP hop = same row, adjacent stages);
    2. number of PP stages holding a straggler (Falcon Fig. 11);
    3. stragglers in the first / last stage (interior preferred, Falcon §5.3);
    4. −Σ stragglers-per-stage² (tie-break that rewards concentrating stragglers);
    5. Σ hop index of slow links (earlier hops have more slackness to absorb a delay, PipeMorph §7.2);
    6. devices moved relative to ``old_grid``;
    7. pipelines whose devices are not in increasing order along the stages (a last tie-break, no
       paper criterion: torch's schedules number a PP group's members by global rank, so the
       in-memory S3 of :mod:`titan_ext.titan.falcon_s3` applies grids without such pipelines).
    """
    g = np.asarray(grid_arg(grid))
    devices = set(int(x) for x in g.ravel())
    slow_links = _links_arg(slow_links, "slow_links", devices)
    stragglers = _ranks_arg(stragglers, "stragglers", devices)
    if old_grid is not None:
        old_grid = np.asarray(grid_arg(old_grid, "old_grid"))
        if old_grid.shape != g.shape:
            raise ValueError(f"old_grid has shape {old_grid.shape}, grid {g.shape}")
    return _score(g, slow_links, stragglers, old_grid)


def _score(g: np.ndarray, slow_links: list[tuple[int, int]], stragglers: list[int], old_grid) -> tuple:
    """:func:`topology_score` of checked arguments (the descent's inner loop)."""
    num_dp, num_pp = g.shape
    pos = _positions(g)
    off_hop = 0
    hop_sum = 0
    for a, b in slow_links:
        (da, sa), (db, sb) = pos[a], pos[b]
        if da == db and abs(sa - sb) == 1:
            hop_sum += min(sa, sb)
        else:
            off_hop += 1
    counts = np.zeros(num_pp, dtype=np.int64)
    for s in stragglers:
        counts[pos[s][1]] += 1
    stages = int((counts > 0).sum())
    exterior = int(counts[0] + (counts[-1] if num_pp > 1 else 0)) if num_pp > 2 else 0
    concentration = -int((counts ** 2).sum())
    moved = 0 if old_grid is None else int((np.asarray(old_grid) != g).sum())
    unordered = int(sum(bool((np.diff(row) < 0).any()) for row in g))
    return (off_hop, stages, exterior, concentration, hop_sum, moved, unordered)


def plan_topology(grid: Sequence[Sequence[int]], slow_links: Iterable[tuple[int, int]] = (),
                  stragglers: Iterable[int] = (), max_rounds: int = 100) -> TopologyPlan:
    """Topology adjustment (Falcon §5.3, Fig. 10/11; PipeMorph §6/§7.3).

    Finds a permutation of ``grid`` (``grid[dp][pp]`` = device) minimising :func:`topology_score`:
    constructive placement (each slow link onto a PP hop of some pipeline, stragglers packed into the
    ``ceil(#stragglers / #DP)`` most interior stages) followed by best-improvement pairwise-swap
    descent. Deterministic. Raises ValueError for a grid with a single PP stage and a slow link
    (there is no PP hop to move it to).
    """
    g0 = np.asarray(grid_arg(grid), dtype=np.int64)
    num_dp, num_pp = g0.shape
    devices = set(int(x) for x in g0.ravel())
    slow_links = _links_arg(slow_links, "slow_links", devices)
    stragglers = sorted(set(_ranks_arg(stragglers, "stragglers", devices)))
    max_rounds = int_arg(max_rounds, "max_rounds", 0)
    if slow_links and num_pp < 2:
        raise ValueError("a single PP stage has no PP hop to carry a slow link")

    def score(g):
        return _score(g, slow_links, stragglers, g0)

    starts = [g0.copy(), _constructive(g0, slow_links, stragglers)]
    best = None
    for g in starts:
        g = _descend(g, score, max_rounds)
        sc = score(g)
        if best is None or sc < best[1]:
            best = (g, sc)
    g, sc = best
    return TopologyPlan(
        grid=tuple(tuple(int(x) for x in row) for row in g),
        old_grid=tuple(tuple(int(x) for x in row) for row in g0),
        score=sc,
        moved=int((g != g0).sum()),
    )


def _interior_order(num_pp: int) -> list[int]:
    """Stages ordered by preference for hosting stragglers: interior first, centre outwards."""
    centre = (num_pp - 1) / 2.0
    return sorted(range(num_pp), key=lambda s: (s in (0, num_pp - 1) and num_pp > 2, abs(s - centre), s))


def _swap(g: np.ndarray, p: tuple[int, int], q: tuple[int, int]) -> None:
    g[p], g[q] = g[q], g[p]


def _constructive(g0: np.ndarray, slow_links, stragglers) -> np.ndarray:
    g = g0.copy()
    num_dp, num_pp = g.shape
    locked: set[tuple[int, int]] = set()
    # Stragglers first: fill the most interior stages, column by column.
    if stragglers:
        k = math.ceil(len(stragglers) / num_dp)
        targets = [(d, s) for s in sorted(_interior_order(num_pp)[:k]) for d in range(num_dp)]
        pos = _positions(g)
        # keep those already in a target cell
        free_targets = [c for c in targets if int(g[c]) not in stragglers]
        for s in stragglers:
            if pos[s] in targets:
                locked.add(pos[s])
        for s in stragglers:
            pos = _positions(g)
            if pos[s] in locked:
                continue
            cell = free_targets.pop(0)
            _swap(g, pos[s], cell)
            locked.add(cell)
    # Slow links: put each onto a free hop (row d, stages h, h+1), earliest hop first.
    for a, b in slow_links:
        pos = _positions(g)
        (da, sa), (db, sb) = pos[a], pos[b]
        if da == db and abs(sa - sb) == 1:
            locked.update({pos[a], pos[b]})
            continue
        placed = False
        for h in range(num_pp - 1):
            for d in range(num_dp):
                for x, y in ((a, b), (b, a)):
                    cx, cy = (d, h), (d, h + 1)
                    ok_x = cx not in locked or int(g[cx]) == x
                    ok_y = cy not in locked or int(g[cy]) == y
                    if ok_x and ok_y and pos[x] not in locked - {cx} and pos[y] not in locked - {cy}:
                        _swap(g, _positions(g)[x], cx)
                        _swap(g, _positions(g)[y], cy)
                        locked.update({cx, cy})
                        placed = True
                        break
                if placed:
                    break
            if placed:
                break
    return g


def _descend(g: np.ndarray, score, max_rounds: int) -> np.ndarray:
    g = g.copy()
    cells = list(itertools.product(range(g.shape[0]), range(g.shape[1])))
    current = score(g)
    for _ in range(max_rounds):
        best = None
        for p, q in itertools.combinations(cells, 2):
            _swap(g, p, q)
            sc = score(g)
            _swap(g, p, q)
            if sc < current and (best is None or sc < best[0]):
                best = (sc, p, q)
        if best is None:
            break
        current = best[0]
        _swap(g, best[1], best[2])
    return g
