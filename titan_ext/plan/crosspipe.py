"""CrossPipe greedy schedule generation (CrossPipe §4.2, Alg.1) — CrossUD, CrossUDSub, CrossWave.

The generator is a list scheduler driven by its own event-driven timing model (CrossPipe §3.5 and
§4.2.3), the same model as ``titan_ext.plan.simulate`` in delegated mode:

* a rank executes one operation at a time;
* a cross-rank dependency becomes available ``α + size·β`` after the producing operation ends, and a
  link direction carries one message at a time (range-based occupancy, §4.2.3: the message takes the
  earliest free window of length ``size·β`` at or after it is ready; latency α is pipelined, i.e. it
  does not occupy the link);
* a same-rank dependency (the V turn of CrossWave, I after F on the last stage, W after I) is
  available as soon as the producer ends.

Scheduling loop (§4.2.2):

* **Stage selection** – the rank with the earliest *schedulable time*, i.e. ``max(end of its last
  operation, earliest availability of an operation it may run now)`` (memory permitting).
* **Operation selection** – among the operations available at that time: warm-up phase (no backward
  has reached the rank yet) → F first; steady phase → F and I (the paper's D) full blocks interleaved;
  tear-down phase (all F of the rank done) → I before W.  W runs when F/I are not available or the
  memory limit forbids an F (§4.2.2 last sentence).  Ties go to the lower microbatch, then to the
  later stage (closer to the loss).
* **Sub-blocks** (§4.2.1): every W is split into ``n_sub`` sub-blocks and scheduled one sub-block at a
  time, so an I or F that arrives while a W is running waits at most one sub-block.  F and I are
  scheduled as full blocks ("interleaves F and D full blocks", §4.2.2), so splitting them would not
  change any decision.  CrossUD is ``n_sub = 1``.

Output: whole actions in torch's IR.  torch's runtime cannot execute part of an action, so the
sub-block timeline is turned into whole actions ordered by the completion time of their last sub-block
(a W interrupted by an I is placed after that I).  The makespan of that whole-action plan is then
recomputed with :func:`replay` (same model), and, like CrossPipe's schedule selection (§6.2), the
generator keeps the best of a portfolio of candidates by that replayed makespan (steady-phase rule,
a one-operation backward lookahead, per-stage in-flight caps from PipeMorph's Alg.1/2, ``n_sub``,
the V-turn memory reserve — see :func:`plan_crosspipe_problem`; ``portfolio=False`` is one run of
Alg.1 as published).

Memory (§4.2, inputs M_F, M_D, M_W, M_L): net memory change per operation in *activation units* — by
default F = +1, I = −1, W = 0, i.e. the limit is on in-flight activations (F done − I done) per rank,
the quantity ``simulate`` reports as ``peak_inflight``.  An F is only scheduled if the rank stays
within its limit; on a rank holding several stages (CrossWave), an F of an earlier stage also keeps
memory free for the later stages on that rank (``reserve``), so the V turn can always proceed (no
memory deadlock).

This module is pure Python: no torch or ortools at import time.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

__all__ = [
    "CrossPipeProblem",
    "GreedyResult",
    "CrossPipePlan",
    "greedy_schedule",
    "replay",
    "plan_crosspipe",
    "plan_crosspipe_problem",
    "problem_from_profile",
    "peak_memory",
    "to_actions",
    "wave_stage_to_rank",
    "CROSSPIPE_VARIANTS",
    "CROSSPIPE_SCHEDULES",
    "plan_by_name",
    "wave_profile",
]

CROSSPIPE_VARIANTS = ("ud", "udsub", "wave")

F, I, W = "F", "I", "W"


def wave_stage_to_rank(num_ranks: int) -> tuple[int, ...]:
    """V-shape placement used by CrossWave and torch's ZBV: stages s and 2S−1−s on rank s."""
    return tuple(list(range(num_ranks)) + list(range(num_ranks - 1, -1, -1)))


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

    def hop(self, src_stage: int, dst_stage: int) -> tuple[int, tuple[int, int]] | None:
        """(stage boundary, channel (src rank, dst rank)) crossed by data from src_stage to the
        adjacent dst_stage; None if both stages sit on the same rank."""
        a, b = self.stage_to_rank[src_stage], self.stage_to_rank[dst_stage]
        if a == b:
            return None
        return (min(src_stage, dst_stage), (a, b))

    def rank_link_boundaries(self, rank_link: int) -> tuple[int, ...]:
        """Stage boundaries whose messages travel between rank ``rank_link`` and ``rank_link + 1``."""
        s2r = self.stage_to_rank
        return tuple(
            s for s in range(self.num_stages - 1) if {s2r[s], s2r[s + 1]} == {rank_link, rank_link + 1}
        )

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


# Operations are plain tuples (stage, kind, microbatch) inside plan/; torch's _Action only at the
# boundary (see to_actions / titan_ext.plan.ir).
Op = tuple  # (stage, kind, microbatch)


_PROBLEM_FIELDS = tuple(f.name for f in dataclasses.fields(CrossPipeProblem))


@dataclass
class GreedyResult:
    """Result of one greedy run (or of a replay): per-rank whole-action orders and their timing."""

    orders: dict[int, list[Op]]
    """rank → whole actions (stage, 'F'|'I'|'W', microbatch) in execution order."""
    start_ms: dict[Op, float]
    end_ms: dict[Op, float]
    makespan_ms: float
    """from the first F on stage 0 to the end of the last action anywhere (CrossPipe App.A)."""
    subblocks: list[tuple[int, Op, int, float, float]] = field(default_factory=list)
    """greedy only: (rank, op, sub-block index, start, end) as scheduled by Alg.1."""
    n_sub: int = 1
    steady: str = "interleave"
    reserve: str | int = "one"
    lookahead: bool = False
    waits: int = 0
    """lookahead only: how often the rank idled for an arriving backward (0: same plan as without)."""


class _Links:
    """Range-based link occupancy (CrossPipe §4.2.3): per (link, direction) sorted busy windows."""

    __slots__ = ("starts", "ends")

    def __init__(self) -> None:
        self.starts: dict[tuple[int, int], list[float]] = {}
        self.ends: dict[tuple[int, int], list[float]] = {}

    def reserve(self, key: tuple[int, int], ready: float, length: float) -> float:
        """Earliest window of ``length`` at or after ``ready`` on ``key``; reserve it; return its end."""
        if length <= 0:
            return ready
        starts = self.starts.setdefault(key, [])
        ends = self.ends.setdefault(key, [])
        if not starts or ready >= ends[-1]:  # common case: after everything booked so far
            starts.append(ready)
            ends.append(ready + length)
            return ready + length
        # first window that ends after `ready`
        i = bisect.bisect_right(ends, ready)
        t = ready
        while i < len(starts):
            if t + length <= starts[i]:
                break
            t = max(t, ends[i])
            i += 1
        starts.insert(i, t)
        ends.insert(i, t + length)
        return t + length


def _message_arrival(problem: CrossPipeProblem, links: _Links, src_stage: int, dst_stage: int, ready: float) -> float:
    hop = problem.hop(src_stage, dst_stage)
    if hop is None:
        return ready
    boundary, channel = hop
    return links.reserve(channel, ready, problem.transfer(boundary)) + problem.latency(boundary)


def greedy_schedule(
    problem: CrossPipeProblem,
    n_sub: int = 1,
    steady: str = "interleave",
    reserve: str | int = "one",
    tie: str = "microbatch",
    lookahead: bool = False,
) -> GreedyResult:
    """One run of CrossPipe's greedy generator (§4.2, Alg.1) with ``n_sub`` sub-blocks per W.

    ``steady`` is the steady-phase rule: ``"interleave"`` (§4.2.2: alternate F and D full blocks) or
    ``"backward_first"`` (I before F whenever both are available).
    ``reserve`` (ranks with several stages, CrossWave): how much memory an F of an earlier stage
    leaves free for the later stages of its rank: ``"one"`` unit per later stage (enough to rule out
    deadlock), an int k: k units per later stage, or ``"pending"``: one unit for every microbatch that
    has passed this stage but not yet a later stage of the rank, so no microbatch already in flight
    ever waits for memory at the V turn.
    ``tie`` (ranks with several stages): which of two available operations of the same kind goes
    first: ``"microbatch"`` – the lower microbatch, then the later stage; ``"critical_path"`` – for
    I, the later stage (the one with the longer remaining backward chain), then the lower microbatch.
    ``lookahead``: before starting an F or W, look at the backward (I) already in flight to this rank;
    if it lands before that F/W would end, wait for it (one-operation lookahead; inserts idle time,
    which Alg.1 never does).
    Raises ValueError if the memory limit admits no schedule (deadlock).
    """
    if tie not in ("microbatch", "critical_path"):
        raise ValueError(f"tie must be 'microbatch' or 'critical_path', got {tie!r}")
    i_later_first = tie == "critical_path"
    if not isinstance(n_sub, int) or n_sub < 1:
        raise ValueError(f"n_sub must be a positive int, got {n_sub!r}")
    if steady not in ("interleave", "backward_first"):
        raise ValueError(f"steady must be 'interleave' or 'backward_first', got {steady!r}")
    if reserve == "one":
        reserve = 1
    if reserve != "pending" and not (isinstance(reserve, int) and reserve >= 1):
        raise ValueError(f"reserve must be 'one', 'pending' or an int >= 1, got {reserve!r}")
    R, N, S = problem.num_ranks, problem.num_microbatches, problem.num_stages
    s2r = problem.stage_to_rank
    last = S - 1
    mf, mi, mw = problem.memory_deltas
    inf = math.inf
    limit = problem.memory_limit
    lim = [inf] * R if limit is None else [x + 1e-9 for x in limit]
    rank_stages = [problem.stages_of_rank(r) for r in range(R)]
    # memory an F of stage s must leave free for the later stages of its rank (V turn): F of stage
    # s is allowed while mem + need_f[s] <= limit
    k_units = 1 if reserve == "pending" else reserve
    need_f = [mf + k_units * mf * sum(1 for s2 in rank_stages[s2r[s]] if s2 > s) for s in range(S)]
    later = [tuple(s2 for s2 in rank_stages[s2r[s]] if s2 > s) for s in range(S)]
    pending_rule = reserve == "pending" and any(later)
    f_stage_done = [0] * S

    def f_blocked(r: int, s: int) -> bool:
        """memory rule for an F of stage s on rank r"""
        if pending_rule and later[s]:
            need = mf * (1 + sum(f_stage_done[s] + 1 - f_stage_done[x] for x in later[s]))
            return mem[r] + need > lim[r]
        return mem[r] + need_f[s] > lim[r]
    total_f = [N * len(rank_stages[r]) for r in range(R)]
    # per stage: (channel, size·β, α) of the message to the next / previous stage (None: same rank)
    fwd_hop = [None] * S
    bwd_hop = [None] * S
    for s in range(S):
        for dst, table in ((s + 1, fwd_hop), (s - 1, bwd_hop)):
            if 0 <= dst < S:
                h = problem.hop(s, dst)
                if h is not None:
                    table[s] = (h[1], problem.transfer(h[0]), problem.latency(h[0]))
    reserve_link = None  # bound below, after `links` exists

    def message(hop, ready: float) -> float:
        if hop is None:
            return ready
        ch, tx, lat = hop
        return reserve_link(ch, ready, tx) + lat
    dur_k = [problem.f_ms, problem.b_ms, tuple(x / n_sub for x in problem.w_ms)]
    backward_first = steady == "backward_first"

    # queue index q = 3*stage + kind (0 F, 1 I, 2 W); entries [mb, avail] in microbatch order
    queues: list[list[list]] = [[] for _ in range(3 * S)]
    heads = [0] * (3 * S)
    queues[0] = [[m, 0.0] for m in range(N)]
    # per rank: queue indices, later stage first (ties in selection go to the later stage)
    rank_q = [[3 * s + k for s in sorted(rank_stages[r], reverse=True) for k in (0, 1, 2)] for r in range(R)]
    w_left: dict[tuple[int, int], int] = {}

    free = [0.0] * R
    mem = [0.0] * R
    f_done = [0] * R
    seen_backward = [False] * R
    last_full = [-1] * R
    links = _Links()
    reserve_link = links.reserve
    start: dict[Op, float] = {}
    end: dict[Op, float] = {}
    subblocks: list[tuple[int, Op, int, float, float]] = []
    remaining = 3 * N * S
    version = [0] * R
    waits = 0
    heap: list[tuple[float, int, int]] = []
    KIND = (F, I, W)

    heappush = heapq.heappush

    def push(r: int) -> None:
        version[r] += 1
        best = inf
        for q in rank_q[r]:
            h = heads[q]
            qq = queues[q]
            if h < len(qq):
                a = qq[h][1]
                if a < best and not (q % 3 == 0 and f_blocked(r, q // 3)):
                    best = a
        if best < inf:
            fr = free[r]
            heappush(heap, (best if best > fr else fr, r, version[r]))

    def arrive(q: int, m: int, avail: float) -> None:
        qq = queues[q]
        if not qq or qq[-1][0] < m:
            qq.append([m, avail])
        else:  # keep microbatch order so the head is the lowest microbatch
            i = len(qq)
            while i > heads[q] and qq[i - 1][0] > m:
                i -= 1
            qq.insert(i, [m, avail])

    for r in range(R):
        push(r)

    while remaining:
        if not heap:
            raise ValueError(
                "CrossPipe greedy: no rank can proceed — the memory limit admits no schedule "
                f"(memory_limit={problem.memory_limit})"
            )
        t, r, ver = heapq.heappop(heap)
        if ver != version[r]:
            continue
        # operations available at t: best (lowest microbatch, then later stage) per kind
        best_k: list = [None, None, None]
        tt = t + 1e-12
        for q in rank_q[r]:
            h = heads[q]
            qq = queues[q]
            if h < len(qq):
                m, a = qq[h]
                if a > tt:
                    continue
                k = q % 3
                if k == 0 and f_blocked(r, q // 3):
                    continue
                cur = best_k[k]
                if cur is None or (m < cur[0] and not (k == 1 and i_later_first)):
                    best_k[k] = (m, q)
        # ---- operation selection (§4.2.2)
        if not seen_backward[r] and best_k[1] is not None:
            seen_backward[r] = True  # warm-up ends when the first backward can run here
        if f_done[r] == total_f[r]:
            order = (1, 2, 0)  # tear-down: D before W
        elif not seen_backward[r]:
            order = (0, 1, 2)  # warm-up: F first
        elif backward_first or last_full[r] == 0:
            order = (1, 0, 2)  # steady: interleave F and D full blocks
        else:
            order = (0, 1, 2)
        for k in order:
            if best_k[k] is not None:
                break
        m, q = best_k[k]
        s = q // 3
        dur = dur_k[k][s]
        t1 = t + dur
        if lookahead and k != 1:
            # a backward already on its way that would land while this F/W runs goes first: idle
            # until it arrives instead of delaying the backward chain (PipeMorph's B > F > W order)
            soonest = inf
            for q2 in rank_q[r]:
                if q2 % 3 == 1 and heads[q2] < len(queues[q2]):
                    a = queues[q2][heads[q2]][1]
                    if a < soonest:
                        soonest = a
            if t < soonest < t1 - 1e-12:
                version[r] += 1
                heapq.heappush(heap, (soonest, r, version[r]))
                waits += 1
                continue
        op = (s, KIND[k], m)
        free[r] = t1
        if k == 2:  # W: one sub-block (§4.2.1)
            nleft = w_left.get((s, m), n_sub)
            subblocks.append((r, op, n_sub - nleft, t, t1))
            if nleft == n_sub:
                start[op] = t
            nleft -= 1
            if nleft:
                w_left[(s, m)] = nleft
                queues[q][heads[q]][1] = t1  # rest of this W stays at the head
            else:
                w_left.pop((s, m), None)
                heads[q] += 1
                end[op] = t1
                mem[r] += mw
                remaining -= 1
            push(r)
            continue
        subblocks.append((r, op, 0, t, t1))
        start[op] = t
        end[op] = t1
        heads[q] += 1
        remaining -= 1
        last_full[r] = k
        if k == 0:
            mem[r] += mf
            f_done[r] += 1
            f_stage_done[s] += 1
            if s < last:
                dst = s + 1
                arrive(3 * dst, m, message(fwd_hop[s], t1))
            else:
                dst = s
                arrive(3 * s + 1, m, t1)
        else:
            mem[r] += mi
            arrive(3 * s + 2, m, t1)
            dst = s
            if s > 0:
                dst = s - 1
                arrive(3 * dst + 1, m, message(bwd_hop[s], t1))
        push(r)
        r2 = s2r[dst]
        if r2 != r:
            push(r2)

    # whole actions ordered by the completion of their last sub-block (ties: start)
    orders: dict[int, list[Op]] = {r: [] for r in range(R)}
    for op in sorted(end, key=lambda o: (end[o], start[o])):
        orders[s2r[op[0]]].append(op)
    makespan = max(end.values()) - start[(0, F, 0)]
    return GreedyResult(orders, start, end, makespan, subblocks, n_sub, steady, reserve, lookahead, waits)


class _Model:
    """The timing model of CrossPipe §3.5 compiled to flat arrays, for fast repeated evaluation of
    fixed per-rank orders (the portfolio's selection by simulation, §6.2, and the local search).

    Operation id ``(3·stage + kind)·N + microbatch`` (kind 0 F, 1 I, 2 W); ``out[id]`` lists what the
    operation's end makes available: ``(op, channel, size·β, α)`` with channel −1 for a same-rank
    dependency.  Every message on a channel is sent by one rank in its program order, so a FIFO per
    channel gives exactly the range-based occupancy of §4.2.3 here (see :func:`replay`).
    """

    __slots__ = ("N", "S", "R", "n", "dur", "out", "rank", "kind", "delta", "nch", "stage_to_rank", "prod", "chan_of",
                 "chan_sender", "cons", "tx_chans", "work", "_no_tail")

    def __init__(self, problem: CrossPipeProblem) -> None:
        N, S, R = problem.num_microbatches, problem.num_stages, problem.num_ranks
        s2r = problem.stage_to_rank
        self.N, self.S, self.R, self.n = N, S, R, 3 * N * S
        self.stage_to_rank = s2r
        chans: dict[tuple[int, int], int] = {}

        def hop(a: int, b: int) -> tuple[int, float, float]:
            h = problem.hop(a, b)
            if h is None:
                return (-1, 0.0, 0.0)
            boundary, channel = h
            return (chans.setdefault(channel, len(chans)), problem.transfer(boundary), problem.latency(boundary))

        dur: list[float] = []
        out: list[tuple] = []
        for s in range(S):
            times = (problem.f_ms[s], problem.b_ms[s], problem.w_ms[s])
            if s < S - 1:
                ch, tx, lat = hop(s, s + 1)
                f_out = [((3 * s + 3) * N + m, ch, tx, lat) for m in range(N)]
            else:
                f_out = [((3 * s + 1) * N + m, -1, 0.0, 0.0) for m in range(N)]
            if s > 0:
                ch, tx, lat = hop(s, s - 1)
                i_out = [(((3 * s + 2) * N + m, -1, 0.0, 0.0), ((3 * s - 2) * N + m, ch, tx, lat)) for m in range(N)]
            else:
                i_out = [(((3 * s + 2) * N + m, -1, 0.0, 0.0),) for m in range(N)]
            for k in range(3):
                dur.extend([times[k]] * N)
            out.extend((x,) for x in f_out)
            out.extend(i_out)
            out.extend([()] * N)
        self.dur, self.out, self.nch = dur, out, len(chans)
        self.rank = [s2r[i // (3 * N)] for i in range(self.n)]
        self.kind = [(i // N) % 3 for i in range(self.n)]
        self.delta = tuple(problem.memory_deltas)
        n = self.n
        self.work = 0
        self._no_tail = [0.0] * self.n
        """operations simulated so far by run/rerun (plus a fixed 4R + 32 per call): the deterministic
        cost measure of the local search's budget."""
        self.prod = [n] * n  # each operation's single producer (n: none, stage 0's F)
        self.chan_of = [-1] * n  # channel an operation's message occupies (-1: none or size·β = 0)
        self.chan_sender = [0] * self.nch
        self.cons = [tuple(x[0] for x in out[o]) for o in range(n)]
        for o in range(n):
            for d, ch, tx, _ in out[o]:
                self.prod[d] = o
                if ch >= 0:
                    self.chan_sender[ch] = self.rank[o]
                    if tx:
                        self.chan_of[o] = ch
        self.tx_chans = sorted({ch for ch in self.chan_of if ch >= 0})

    def ids(self, orders: Mapping[int, Sequence[Op]]) -> list[list[int]]:
        N, kid = self.N, {F: 0, I: 1, W: 2}
        return [[(3 * s + kid[k]) * N + m for s, k, m in orders[r]] for r in range(self.R)]

    def ops(self, ids: Sequence[Sequence[int]]) -> dict[int, list[Op]]:
        N, K = self.N, (F, I, W)
        return {r: [(i // (3 * N), K[(i // N) % 3], i % N) for i in o] for r, o in enumerate(ids)}

    def run(self, orders: Sequence[Sequence[int]], detail: bool = False, bound: float = math.inf,
            tail: Sequence[float] | None = None):
        """Time per-rank id orders.  Returns (makespan, Σ rank finish times) — inf if they deadlock or
        if some operation ends after ``bound`` (or, with ``tail``, see :meth:`rerun`, its end plus its
        rank's remaining work does) — or with ``detail`` a :class:`_Timed` (the state :meth:`rerun`
        restarts from)."""
        N, R = self.N, self.R
        avail = [-1.0] * self.n
        avail[:N] = [0.0] * N
        return self._loop(orders, avail, [0] * R, [0.0] * R, [0.0] * self.nch, 0, detail, bound, None,
                          tail=None if detail else tail)

    def spec(self) -> tuple:
        """The model as plain tuples for the compiled engine (``_search.c``)."""
        return (self.N, self.R, self.nch, self.dur, self.out, self.rank, self.kind, self.prod, self.delta)

    def rerun(self, orders: Sequence[Sequence[int]], base: "_Timed", r: int, lo: int, hi: int,
              bound: float = math.inf, detail: bool = False, tail: Sequence[float] | None = None):
        """Time ``orders``, which differ from the timed ``base`` only on rank ``r`` at positions lo..hi:
        every operation that started before the earliest of those (in ``base``) keeps its times (it
        cannot depend on them), so the run restarts from that point.  Same result as :meth:`run`.
        ``tail`` (per operation id: the total duration of the operations after it on its rank, see
        :func:`_rank_tails`; only without ``detail``) aborts the run as soon as an operation's end plus
        its rank's remaining work exceeds ``bound`` (that run's makespan would exceed it too)."""
        st = base.start
        T = min(st[x] for x in orders[r][lo:hi + 1])
        R = self.R
        rank_starts = base.rank_starts
        pos = [bisect.bisect_left(rank_starts[x], T) for x in range(R)]
        if pos[r] > lo:
            pos[r] = lo
        if not any(pos):
            return self.run(orders, detail=detail, bound=bound)
        dur, chan_of, msgres = self.dur, self.chan_of, base.msgres
        free = [0.0] * R
        for x in range(R):
            k = pos[x]
            if k:
                o = orders[x][k - 1]
                free[x] = st[o] + dur[o]
        chfree = [0.0] * self.nch
        for ch in self.tx_chans:
            x = self.chan_sender[ch]
            o = orders[x]
            k = pos[x] - 1
            while k >= 0:
                if chan_of[o[k]] == ch:
                    chfree[ch] = msgres[o[k]]
                    break
                k -= 1
        avail = base.avail[:]
        cons = self.cons
        self.work += (self.n - sum(pos)) // 2 + 2 * R  # the reset below
        for x in range(R):
            for o in orders[x][pos[x]:]:
                for d in cons[o]:
                    avail[d] = -1.0
        first = st[0] if st[0] < T else None
        if detail:
            return self._loop(orders, avail, pos, free, chfree, sum(pos), True, bound, first,
                              base.start[:], base.msgres[:], base.rank_starts)
        return self._loop(orders, avail, pos, free, chfree, sum(pos), False, bound, first, tail=tail)

    def _loop(self, orders, avail, pos, free, chfree, done, detail, bound, first, start=None, msgres=None,
              base_starts=None, tail=None):
        dur, out, rank = self.dur, self.out, self.rank
        if tail is None:
            tail = self._no_tail
            tbound = bound
        else:
            tbound = bound + 1e-7  # the tail sums round differently from the run's own additions
        R = self.R
        if detail and start is None:
            start = [0.0] * self.n + [-1.0]  # start[n]: the "producer" of stage 0's F (see prod)
            msgres = [0.0] * self.n
        pos0 = pos[:]
        work = list(range(R))
        queued = [True] * R
        done0 = done
        self.work += 4 * R + 32
        while work:
            r = work.pop()
            queued[r] = False
            ops = orders[r]
            p0 = p = pos[r]
            fr = free[r]
            L = len(ops)
            while p < L:
                o = ops[p]
                a = avail[o]
                if a < 0:
                    break
                t = a if a > fr else fr
                if detail:
                    start[o] = t
                elif o == 0:
                    first = t
                fr = t + dur[o]
                if fr > bound or fr + tail[o] > tbound:
                    self.work += done + p - p0 - done0
                    return math.inf, math.inf
                for d, ch, tx, lat in out[o]:
                    if ch < 0:
                        avail[d] = fr
                    elif tx:
                        s0 = chfree[ch]
                        if fr > s0:
                            s0 = fr
                        s0 += tx
                        chfree[ch] = s0
                        if detail:
                            msgres[o] = s0
                        avail[d] = s0 + lat
                    else:
                        avail[d] = fr + lat
                    x = rank[d]
                    if x != r and not queued[x]:
                        queued[x] = True
                        work.append(x)
                p += 1
            done += p - p0
            pos[r] = p
            free[r] = fr
        self.work += done - done0
        if detail:
            first = start[0]
            mk = max(free) - first if done == self.n else math.inf
            if base_starts is None:
                rank_starts = [[start[x] for x in o] for o in orders]
            else:
                self.work += 2 * R
                rank_starts = [base_starts[x][:k] + [start[y] for y in orders[x][k:]] for x, k in enumerate(pos0)]
            return _Timed(mk, sum(free) if mk < math.inf else math.inf, start, avail, pos, msgres, rank_starts)
        if done != self.n:
            return math.inf, math.inf
        return max(free) - first, sum(free)


@dataclass
class _Timed:
    """Detailed result of :meth:`_Model.run`."""

    makespan: float
    finish_sum: float
    start: list
    """start time per operation id (plus ``start[n] = −1``)."""
    avail: list
    """time each operation's input is there."""
    pos: list
    """per rank: operations done (all of them unless deadlocked)."""
    msgres: list
    """per sending operation: the end of its message's window on its channel."""
    rank_starts: list
    """per rank: start times in program order."""


def replay(problem: CrossPipeProblem, orders: Mapping[int, Sequence[Op]]) -> GreedyResult:
    """Time fixed per-rank whole-action orders with the same model (CrossPipe §3.5): each action
    starts when its rank is free and its input has arrived; messages use range-based link occupancy.

    Every message on a link direction is sent by the same rank (the one on its near side), in that
    rank's program order, so ready times per direction are non-decreasing whatever order ranks are
    advanced in: a work list suffices and a FIFO per direction equals the range-based reservation of
    a chronological run.  Implemented on :class:`_Model` (flat arrays; also the portfolio's and the
    local search's evaluator).

    Raises ValueError if the orders deadlock or miss/duplicate an action.
    """
    R, N, S = problem.num_ranks, problem.num_microbatches, problem.num_stages
    s2r = problem.stage_to_rank
    expected = 3 * N * S
    seen = set()
    for r, ops in orders.items():
        for op in ops:
            if op in seen:
                raise ValueError(f"action {op} appears twice")
            if s2r[op[0]] != r:
                raise ValueError(f"action {op} is on rank {r}, but its stage sits on rank {s2r[op[0]]}")
            seen.add(op)
    if len(seen) != expected:
        raise ValueError(f"plan has {len(seen)} actions, expected {expected}")
    model = _Model(problem)
    ids = model.ids({r: orders.get(r, ()) for r in range(R)})
    res = model.run(ids, detail=True)
    mk, st, pos = res.makespan, res.start, res.pos
    if mk == math.inf:
        stuck = {r: orders[r][pos[r]] for r in range(R) if pos[r] < len(orders[r])}
        raise ValueError(f"plan deadlocks; next actions per rank: {stuck}")
    start: dict[Op, float] = {}
    end: dict[Op, float] = {}
    dur = model.dur
    for r in range(R):
        for op, i in zip(orders[r], ids[r]):
            start[op] = st[i]
            end[op] = st[i] + dur[i]
    return GreedyResult({r: list(v) for r, v in orders.items()}, start, end, mk)


def _critical_moves(model: _Model, ids: list[list[int]], start: list[float], avail: list[float], depth: int,
                    long_moves: int = 0, gap_fill: bool = False):
    """Candidate moves ``(rank, from, to)`` around the critical path of a timed plan.

    The path is walked back from the last-ending operation: an operation that waited for its rank
    (input there before the rank was free) continues the path through its rank predecessor, one that
    waited for its input through the producer.  For every operation that waited for its rank, the
    moves are: run it up to ``depth`` positions earlier (while it could start before the operation it
    jumps), and run its rank predecessor up to ``depth`` positions later — the neighbourhood of
    job-shop local search (adjacent swaps on critical blocks and short insertions).  ``long_moves``
    adds one long move per such predecessor: 1 — a W is deferred as far as it can go (just before
    its stage's next W; the last stage's tail of W's is what lets the backward chain of the last
    microbatches overlap, ZeroBubble-style); 2 — any kind.  ``gap_fill``: where the path meets an
    operation its rank idled for, also try running a later operation of the rank in that gap (the
    first of each other stage and kind within ``4·depth`` positions whose input was already there).
    Moves never reorder two operations of the same stage and kind (microbatch order, as the greedy
    and the solver).
    """
    N, dur, rank, kind = model.N, model.dur, model.rank, model.kind
    model.work += 8 * model.R  # counted in the local search's budget
    S = model.S
    eps = 1e-9
    # the last-ending operation: the last one of some rank
    cur = max((o[-1] for o in ids if o), key=lambda i: start[i] + dur[i])
    moves: list[tuple[int, int, int]] = []
    seen = set()
    while True:
        r = rank[cur]
        o = ids[r]
        p = o.index(cur)
        model.work += 4
        prev = o[p - 1] if p > 0 else -1
        if p > 0:
            rank_bound = start[cur] <= start[prev] + dur[prev] + eps and avail[cur] < start[cur] - eps
        else:
            rank_bound = False
        if rank_bound:
            cls = cur // N
            q = p - 1
            while q >= 0 and p - q <= depth:
                a = o[q]
                if a // N == cls or avail[cur] >= start[a] + dur[a] - eps:
                    break
                if (r, p, q) not in seen:
                    seen.add((r, p, q))
                    moves.append((r, p, q))
                q -= 1
            pcls = prev // N
            for q in range(p, min(len(o), p - 1 + depth)):
                if o[q] // N == pcls:
                    break
                if (r, p - 1, q) not in seen and q != p:
                    seen.add((r, p - 1, q))
                    moves.append((r, p - 1, q))
            if long_moves == 2 or (long_moves == 1 and kind[prev] == 2):
                q = p
                while q < len(o) and o[q] // N != pcls:
                    q += 1
                if q - 1 >= p - 1 + depth and (r, p - 1, q - 1) not in seen:
                    # defer as far as microbatch order allows: just before its stage's next op of its kind
                    seen.add((r, p - 1, q - 1))
                    moves.append((r, p - 1, q - 1))
            cur = prev
            continue
        # input-bound (or the first operation): follow the producer
        if gap_fill and p > 0 and start[cur] > start[prev] + dur[prev] + eps:
            # the rank idled before cur: run a later operation in that gap instead — the first one of
            # each other stage and kind after cur (microbatch order) whose input was there before cur
            # started, nearest first (a bottleneck rank must not idle while it has W's to do)
            cls, found = cur // N, set()
            for j in range(p + 1, min(len(o), p + 1 + 4 * depth)):
                y = o[j]
                ycls = y // N
                if ycls in found or ycls == cls:
                    continue
                found.add(ycls)
                if avail[y] < start[cur] - eps and (r, j, p) not in seen:
                    seen.add((r, j, p))
                    moves.append((r, j, p))
        s, k, m = cur // (3 * N), (cur // N) % 3, cur % N
        if k == 0:
            if s == 0:
                break
            cur = (3 * s - 3) * N + m
        elif k == 1:
            cur = (3 * s) * N + m if s == S - 1 else (3 * s + 4) * N + m
        else:
            cur = (3 * s + 1) * N + m
    return moves


def _move(o: list, p: int, q: int) -> None:
    o.insert(q, o.pop(p))


def _rank_tails(model: _Model, ids: Sequence[Sequence[int]]) -> list[float]:
    """Per operation id: the total duration of the operations after it in its rank's order (a lower
    bound on how long its rank still runs once it ends)."""
    dur = model.dur
    tail = [0.0] * model.n
    for o in ids:
        acc = 0.0
        for x in reversed(o):
            tail[x] = acc
            acc += dur[x]
    return tail


def _update_tails(model: _Model, tail: list[float], o: Sequence[int], lo: int, hi: int) -> None:
    """Refresh ``tail`` (see :func:`_rank_tails`) at positions lo..hi of rank order ``o`` after a move
    inside that range (the operations outside it keep theirs)."""
    dur = model.dur
    acc = tail[o[hi + 1]] + dur[o[hi + 1]] if hi + 1 < len(o) else 0.0
    for j in range(hi, lo - 1, -1):
        x = o[j]
        tail[x] = acc
        acc += dur[x]


def _memory_ok(model: _Model, o: Sequence[int], lo: int, hi: int, limit: float) -> bool:
    """Whether the memory of rank order ``o`` stays within ``limit`` at positions lo..hi (the only ones
    a move inside that range changes)."""
    kind, delta = model.kind, model.delta
    cur = 0.0
    for j in range(hi + 1):
        cur += delta[kind[o[j]]]
        if j >= lo and cur > limit + 1e-9:
            return False
    return True


def _local_search(model: _Model, ids: list[list[int]], limit: Sequence[float], budget: float, depth: int = 4,
                  deadline: float | None = None, max_evals: int | None = None,
                  long_moves: int = 0, gap_fill: bool = False) -> tuple[list[list[int]], float, int]:
    """First-improvement local search on whole-action orders (our addition to Alg.1; §6.2's selection by
    simulation applied to single moves).  Objective: (makespan, Σ rank finish times), lexicographic —
    the second term lets the search walk across plateaus of equal makespan without cycling.  Moves:
    :func:`_critical_moves`; a move is kept only if every rank stays within its memory limit and the
    plan still runs to completion.  Each candidate is timed by :meth:`_Model.rerun` (restart from the
    first moved operation, abort once the makespan is exceeded — or once an operation's end plus the
    rest of its rank's work exceeds it, :func:`_rank_tails`).  ``budget`` in operations simulated
    (``_Model.work``; a move is only tried while a full replay still fits); deterministic unless
    ``deadline`` (a ``time.perf_counter()`` value) cuts it short.  ``max_evals`` additionally stops it
    after that many timings (the base plan's counts as one): the budget of the compiled engine
    (``_search.c``'s ``descent``, which returns the same plan for the same ``max_evals``).
    ``long_moves``, ``gap_fill``: see :func:`_critical_moves`.
    Returns (ids, makespan, evaluations)."""
    w0 = model.work
    max_evals = math.inf if max_evals is None else max_evals
    base = model.run(ids, detail=True)
    mk, sf = base.makespan, base.finish_sum
    evals = 1
    n = model.n
    tail = _rank_tails(model, ids)
    while model.work - w0 + n <= budget and evals < max_evals:
        improved = False
        for r, p, q in _critical_moves(model, ids, base.start, base.avail, depth, long_moves, gap_fill):
            if (model.work - w0 + n > budget or evals >= max_evals
                    or (deadline is not None and time.perf_counter() > deadline)):
                return ids, mk, evals
            o = ids[r]
            lo, hi = (p, q) if p < q else (q, p)
            _move(o, p, q)
            if not _memory_ok(model, o, lo, hi, limit[r]):
                _move(o, q, p)
                continue
            _update_tails(model, tail, o, lo, hi)
            m2, s2 = model.rerun(ids, base, r, lo, hi, bound=base.start[0] + mk + 1e-9, tail=tail)
            evals += 1
            if m2 < mk - 1e-9 or (m2 <= mk + 1e-9 and s2 < sf - 1e-9):
                base = model.rerun(ids, base, r, lo, hi, detail=True)
                mk, sf = base.makespan, base.finish_sum
                improved = True
                break
            _move(o, q, p)
            _update_tails(model, tail, o, lo, hi)
        if not improved:
            break
    return ids, mk, evals


_MASK64 = (1 << 64) - 1


def _splitmix64(state: list[int]) -> int:
    """splitmix64 (state in a one-element list): the annealing's random numbers, bit-identical to
    ``_search.c``'s."""
    state[0] = z = (state[0] + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _anneal(model: _Model, ids: list[list[int]], limit: Sequence[float], max_evals: int, seed: int, t0: float,
            max_shift: int = 6) -> tuple[list[list[int]], float, int]:
    """Simulated annealing on whole-action orders (our addition; the reference of ``_search.c``'s
    ``anneal``, which returns the same plan — the planner runs the compiled one).

    A move shifts one random operation of a random rank by 1..``max_shift`` positions (never past an
    operation of its own stage and kind, never over the rank's memory limit).  Metropolis acceptance
    on the makespan with a linearly falling temperature ``t0·(1 − evals/max_evals)``: the threshold
    ``current − T·ln u`` is drawn *before* the move is timed, so the timing stops as soon as the
    threshold is exceeded (and, with :func:`_rank_tails`, as soon as an operation's end plus its
    rank's remaining work exceeds it).  Where the critical-path descent stops at a local optimum
    (B2 of the benchmark: every ±10 insertion and every pair of ±2 moves fails), accepting slightly
    worse plans crosses to other basins.  Returns the best plan seen: (ids, makespan, evaluations)."""
    N, R = model.N, model.R
    mk, _ = model.run(ids)
    best_mk, best = mk, [list(o) for o in ids]
    tail = _rank_tails(model, ids)
    state = [seed & _MASK64]
    evals = attempts = 0
    max_attempts = 64 * max_evals + 1024
    while evals < max_evals and attempts < max_attempts and mk < math.inf:
        attempts += 1
        r = _splitmix64(state) % R
        o = ids[r]
        L = len(o)
        p = _splitmix64(state) % (L if L > 0 else 1)
        d = 1 + _splitmix64(state) % max_shift
        if _splitmix64(state) & 1:
            d = -d
        q = p + d
        if L < 2 or q < 0 or q >= L:
            continue
        lo, hi = (p, q) if p < q else (q, p)
        cls = o[p] // N
        if any(o[j] // N == cls for j in range(lo, hi + 1) if j != p):
            continue
        _move(o, p, q)
        if not _memory_ok(model, o, lo, hi, limit[r]):
            _move(o, q, p)
            continue
        _update_tails(model, tail, o, lo, hi)
        u = (_splitmix64(state) >> 11) * (1.0 / 9007199254740992.0)
        temp = t0 * (1.0 - evals / max_evals)
        thr = mk + temp * -math.log(u) if u > 0.0 else math.inf
        evals += 1
        m2, _ = model.run(ids, bound=thr, tail=tail)
        if m2 < math.inf:
            mk = m2
            if m2 < best_mk - 1e-9:
                best_mk, best = m2, [list(x) for x in ids]
        else:
            _move(o, q, p)
            _update_tails(model, tail, o, lo, hi)
    return best, best_mk, evals


def improve_orders(problem: CrossPipeProblem, orders: Mapping[int, Sequence[Op]], budget: float = math.inf,
                   depth: int = 4) -> tuple[dict[int, list[Op]], float, int]:
    """Local search (:func:`_local_search`) from fixed per-rank orders within ``problem``'s memory
    limit.  Returns (orders, replayed makespan, evaluations)."""
    model = _Model(problem)
    limit = problem.memory_limit or (math.inf,) * problem.num_ranks
    ids, mk, ev = _local_search(model, model.ids(orders), limit, budget, depth)
    return model.ops(ids), mk, ev


def peak_memory(problem: CrossPipeProblem, orders: Mapping[int, Sequence[Op]]) -> list[float]:
    """Peak memory per rank (activation units, ``memory_deltas``) over each rank's program order."""
    mf, mi, mw = problem.memory_deltas
    delta = {F: mf, I: mi, W: mw}
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
    from .ir import to_torch_plan

    return to_torch_plan({r: list(ops) for r, ops in sorted(orders.items())})


# ----------------------------------------------------------------------------- planner API
@dataclass
class CrossPipePlan:
    """A CrossPipe plan: torch-IR actions plus what the generator knows about it."""

    actions: dict
    """rank → list[_Action] (F / I / W, compute only)."""
    orders: dict[int, list[Op]]
    stage_to_rank: tuple[int, ...]
    variant: str
    n_sub: int
    steady: str
    reserve: str | int
    lookahead: bool
    caps: str
    """which in-flight caps the winning member used ("limit" = the memory limit alone)."""
    makespan_ms: float
    """makespan of the whole-action plan under the generator's model (replayed)."""
    greedy_makespan_ms: float
    """makespan of the greedy's own (sub-block) timeline."""
    memory_limit: tuple[float, ...] | None
    peak_memory: list[float]
    plan_ms: float
    candidates: list[tuple[str, int, str, str | int, bool, float]] = field(default_factory=list)
    """(caps, n_sub, steady, reserve, lookahead, replayed makespan) of every portfolio member tried."""
    improved: bool = False
    """whether the local search improved the best member (then ``orders`` differ from its greedy plan)."""


DEFAULT_BUDGET = 25_000
"""Default work budget of :func:`plan_crosspipe_problem`, in operations replayed (one replay of a plan
= its 3·N·S operations; one greedy run = ``GREEDY_COST`` per scheduling step).  Sized so that the
S=8, N=32 benchmark cases plan in ≤ 10 ms on a 2-core x86_64 VM (docs/benchmarks/crosspipe.md)."""
GREEDY_COST = 9
"""Cost of one Alg.1 scheduling step relative to one replayed operation (measured: ≈ 3 µs vs 0.35 µs)."""

# Portfolio members tried first (cap, n_sub, steady, lookahead), chosen on scripts/bench_optimality.py's
# cases (greedy + local search): the cheapest good start first (n_sub = 1, PipeMorph's Alg.2 caps with
# slack floor 1), then the members that add most; the rest of the product follows in enumeration order.
_UD_PRIORITY = (
    ("alg2-floor1", 1, "interleave", 1, False),
    ("limit", 1, "interleave", 1, False),
    ("alg2", 4, "backward_first", 1, False),
    ("alg1", 1, "interleave", 1, False),
    ("limit", 2, "interleave", 1, True),
    ("alg2-floor1", 2, "backward_first", 1, False),
    ("limit", 4, "interleave", 1, True),
    ("alg2-floor1", 4, "interleave", 1, False),
)
# CrossWave (cap, n_sub, steady, V-turn reserve, lookahead): the members that win on the delay table
# (docs/benchmarks/crosspipe.md §1); torch's ZBV order is always added (plan_crosspipe's ``zbv``).
_WAVE_PRIORITY = (
    ("limit", 1, "interleave", "pending", False),
    ("limit", 1, "interleave", 1, False),
    ("limit", 1, "backward_first", "pending", False),
)
_MEMBER_SHARE = 0.5
"""share of the budget the greedy members may use before the local search starts."""
_MIN_MEMBERS = {"wave": len(_WAVE_PRIORITY)}
"""members always generated, whatever the budget, and not charged to it (CrossWave: its three
delay-table winners; the default UD budget is unchanged)."""
_NEIGHBOUR_MAX_STAGES = 4
"""cap-neighbour members (``_cap_neighbours``) only on problems with at most this many stages, where a
greedy run is cheap (S=4, N=12: ≈ 0.5 ms)."""
_NEIGHBOUR_SHARE = 0.24
"""on those problems the budget grows by this fraction of itself (6 000 at the default budget), first
spent on the cap-neighbour members; what they leave goes to the local search."""
_SMALL_MEMBER_SHARE = 0.4
"""the members' share of the budget on those problems (the cap neighbours explore too; the rest of the
work goes to the local search)."""
_NEIGHBOUR_FIRST = 0.03
"""the best cap neighbour is the first local-search start when its replayed makespan is within this
fraction of the best member's."""
_MAX_STARTS = 4
"""local search from at most this many of the best members (in order, while the budget lasts)."""
_DEPTH = 4
"""how far (positions) a local-search move may shift an operation."""


COMPILED_SCALE = 40
"""How many more operations the compiled path (``_search.c``, ``_greedy.c``) simulates for the same
``budget``: its per-operation cost relative to the Python evaluator's (measured on the benchmark cases:
≈ 6–8 ns vs ≈ 0.3 µs per timed operation, with call overheads), so a budget buys about the same time
on either path."""
GREEDY_C_UNITS = 20
"""Cost of one compiled Alg.1 scheduling step in compiled timing units (operations timed)."""
EVAL_UNITS = 64
"""Fixed cost of one compiled timing (call, reset) on top of its operations, in the same units."""
SETUP_UNITS = 400
"""Per operation of the problem: the planner's own Python work around the compiled parts (the
model, the cap vectors, the torch-IR conversion), charged first so the budget covers the whole call."""
_C_MEMBER_SHARE = 0.5
"""compiled path: share of the budget for the portfolio members (greedy runs and their timing)."""
_C_DESCENT_SHARE = 0.2
"""compiled path: further share for the descents from the best members (the rest: annealing)."""
_C_STARTS = 16
"""compiled path: descents from at most this many members (distinct plans, best first)."""
_C_LONG_ORDER = (1, 0)
"""the descents from each start: with the long W moves first, then without (``_critical_moves``)."""
_C_SEED = 1
_C_TEMPERATURE = 0.0007
"""annealing start temperature as a fraction of the makespan it starts from (short runs: cool)."""
_C_SHIFT = 6
"""annealing moves shift an operation by up to this many positions."""
_C_POLISH = 300
"""evaluations of the descent after the annealing."""
_C_UNLIMITED_ANNEAL = 50_000
"""``budget=None``: annealing evaluations."""


@functools.lru_cache(maxsize=1)
def _engine():
    """The compiled search engine (``titan_ext.plan._search_c``, built from ``_search.c`` by setup.py),
    or None when it is not built."""
    try:
        from . import _search_c
    except ImportError:
        return None
    return _search_c


def _compiled() -> bool:
    """Whether the compiled planner path can run: the search engine and the compiled Alg.1
    (``_greedy_fast``) are both built.  Otherwise the pure-Python path runs (same members, fewer of
    them, descent only)."""
    try:
        from . import _greedy_fast
    except ImportError:
        return False
    return _engine() is not None and _greedy_fast.available()


def _cap_vectors(problem: CrossPipeProblem, problems: Mapping[str, CrossPipeProblem]):
    """([(name, problem)] of the named cap vectors (``problems``), [… of their neighbours]) — each vector with
    one stage's cap lowered by one (``name/sK-1``) and with the caps of stages K..S−2 all lowered by one
    (``name/sK+-1``: every later stage one warm-up microbatch shorter, so the first backward returns
    sooner), stage S−1 untouched (its F waits for nothing), caps ≥ 1; duplicates dropped."""
    seen = set()
    named, out = [], []  # out: the neighbours
    for name, prob in problems.items():
        base = prob.memory_limit or problem.memory_limit
        key = tuple(base) if base is not None else None
        if key not in seen:
            seen.add(key)
            named.append((name, prob))
    if problem.memory_limit is None:
        return named, out
    S = problem.num_stages
    for name, prob in named:
        base = [math.floor(x + 1e-9) for x in (prob.memory_limit or problem.memory_limit)]
        for s in range(S - 1):
            for tag, vec in ((f"{name}/s{s}-1", [c - 1 if i == s else c for i, c in enumerate(base)]),
                             (f"{name}/s{s}+-1", [c - 1 if s <= i < S - 1 else c for i, c in enumerate(base)])):
                v = tuple(float(c) for c in vec)
                if min(v) < 1 or v in seen:
                    continue
                seen.add(v)
                try:
                    out.append((tag, problem.with_memory_limit(v)))
                except ValueError:
                    continue
    return named, out


def _ud_members(problem, problems, members, subs, steadies, pool):
    """The compiled path's UD members in the order they are generated (while the budget lasts):
    the named cap vectors with the first steady rule (interleave) and every ``n_sub``; then, with the
    (steady rule, n_sub) of the best plan so far first, the cap neighbours (:func:`_cap_vectors`) and
    the named vectors with the other combinations; the lookahead members last.  ``pool()`` → the
    members timed so far ``(makespan, index, (name, n_sub, steady, reserve, lookahead), …)``."""
    named, neighbours = _cap_vectors(problem, problems)
    combos = sorted(((st, ns) for st in steadies for ns in subs), key=lambda x: (x[0] != "interleave", x[1]))
    first = [c for c in combos if c[0] == combos[0][0]]
    for st, ns in first:
        for name, prob in named:
            yield name, prob, ns, st, 1, False
    done = pool()
    if done:
        _, _, (_, ns0, st0, _, _) = min(done, key=lambda x: (x[0], x[1]))[:3]
        combos.sort(key=lambda c: c != (st0, ns0))
    for st, ns in combos:
        if (st, ns) not in first:
            for name, prob in named:
                yield name, prob, ns, st, 1, False
        for name, prob in neighbours:
            yield name, prob, ns, st, 1, False
    for c, ns, rs, st, la in members:
        if la:
            yield c, problems[c], ns, st, rs, la


def _plan_compiled(problem, variant, problems, members, subs, steadies, budget, extra, t0, deadline, convert):
    """The compiled planner path of :func:`plan_crosspipe_problem` (our addition to Alg.1, §4.2):

    1. **members**: Alg.1 (``_greedy.c``, bit-identical to :func:`greedy_schedule`) for every member of
       the portfolio, and — UD variants — for the *cap neighbours* of every named in-flight cap vector
       (:func:`_cap_vectors`: one stage, or every stage from one on, one warm-up microbatch shorter);
       each plan timed in the whole-action model;
    2. **descent** (critical-path local search, :func:`_local_search`, with the long W moves and the
       gap filling of :func:`_critical_moves`) from the best ``_C_STARTS`` members;
    3. **annealing** (:func:`_anneal`) from the best plan so far, then a short
       descent.

    All of it in deterministic units (operations timed; ``budget`` × ``COMPILED_SCALE``): members while
    ``_C_MEMBER_SHARE`` lasts, descents while ``_C_DESCENT_SHARE`` lasts, annealing with the rest."""
    from . import _greedy_fast

    eng = _engine()
    model = _Model(problem)
    cap = eng.model(model.spec())
    n, R = model.n, problem.num_ranks
    limit = tuple(problem.memory_limit or (math.inf,) * R)
    unlimited = budget is None
    total = math.inf if unlimited else float(budget) * COMPILED_SCALE
    steps = 3 * problem.num_microbatches * problem.num_stages
    used = float(SETUP_UNITS * n)
    if variant == "wave":
        todo = [(c, problems[c], ns, st, rs, la) for c, ns, rs, st, la in members]
    else:
        todo = _ud_members(problem, problems, members, subs, steadies, lambda: pool)
    pool, tried, error = [], [], None
    for name, prob, ns, st, rs, la in todo:
        cost = GREEDY_C_UNITS * (steps + (ns - 1) * problem.num_microbatches * problem.num_stages) + n + EVAL_UNITS
        if pool and not unlimited and (used + cost > total * _C_MEMBER_SHARE or
                                       (deadline is not None and time.perf_counter() > deadline)):
            break
        used += cost
        try:
            ids, gmk, _ = _greedy_fast.greedy_ids(prob, ns, st, rs, "microbatch", la)
        except ValueError as e:  # this member's memory rule admits no schedule
            tried.append((name, ns, st, rs, la, math.inf))
            error = e
            continue
        mk = eng.run(cap, ids, math.inf)[0]
        tried.append((name, ns, st, rs, la, mk))
        if mk < math.inf:
            pool.append((mk, len(pool), (name, ns, st, rs, la), gmk, ids))
    for name, orders in (extra or {}).items():
        if any(r not in orders for r in range(R)):
            continue
        if any(pk > lim + 1e-9 for pk, lim in zip(peak_memory(problem, orders), limit)):
            continue
        ids = model.ids(orders)
        mk = eng.run(cap, ids, math.inf)[0]
        tried.append((name, 0, "", 0, False, mk))
        if mk < math.inf:
            pool.append((mk, len(pool), (name, 0, "", 0, False), mk, ids))
    if not pool:
        raise error
    pool.sort(key=lambda x: (x[0], x[1]))
    best_mk, _, best_desc, best_gmk, best_ids = pool[0]
    first_mk = best_mk

    def left_evals(share: float) -> int:
        if unlimited:
            return 1 << 40
        return int(max(0.0, total * share - used) // (n + EVAL_UNITS))

    seen_plans = set()
    for mk0, _, desc, gmk, ids0 in pool:
        if len(seen_plans) >= _C_STARTS:
            break
        key = hash(tuple(map(tuple, ids0)))  # members with other caps often give the very same plan
        if key in seen_plans:
            continue
        seen_plans.add(key)
        for long_moves in _C_LONG_ORDER:
            ev_cap = left_evals(_C_MEMBER_SHARE + _C_DESCENT_SHARE)
            if ev_cap < 1 or (deadline is not None and time.perf_counter() > deadline):
                break
            ids1, mk1, ev = eng.descent(cap, ids0, limit, ev_cap, _DEPTH, long_moves, 1)
            used += ev * (n + EVAL_UNITS)
            if mk1 < best_mk - 1e-9:
                best_mk, best_desc, best_gmk, best_ids = mk1, desc, gmk, ids1
    anneal_evals = _C_UNLIMITED_ANNEAL if unlimited else left_evals(1.0) - _C_POLISH
    if anneal_evals >= 1 and (deadline is None or time.perf_counter() < deadline):
        ids2, mk2, _ = eng.anneal(cap, best_ids, limit, anneal_evals, _C_SEED, _C_TEMPERATURE * best_mk, _C_SHIFT)
        ids2, mk2, _ = eng.descent(cap, ids2, limit, _C_POLISH, _DEPTH, 1, 1)
        if mk2 < best_mk - 1e-9:
            best_mk, best_ids = mk2, ids2
    orders = model.ops(best_ids)
    cap_name, ns, st, rs, la = best_desc
    return CrossPipePlan(
        actions=to_actions(orders) if convert else {},
        orders=orders,
        stage_to_rank=problem.stage_to_rank,
        variant=variant,
        n_sub=ns,
        steady=st,
        reserve=rs,
        lookahead=la,
        caps=cap_name,
        makespan_ms=best_mk,
        greedy_makespan_ms=best_gmk,
        memory_limit=problem.memory_limit,
        peak_memory=peak_memory(problem, orders),
        plan_ms=(time.perf_counter() - t0) * 1e3,
        candidates=tried,
        improved=best_mk < first_mk - 1e-9,
    )


def _cap_neighbours(problem: CrossPipeProblem, problems: Mapping[str, CrossPipeProblem], desc: tuple):
    """(name, problem, desc) for the cap-neighbour members of portfolio member ``desc`` = (cap name,
    n_sub, steady, reserve, lookahead): its per-stage in-flight caps with one stage (not the last, whose
    F waits for nothing) lowered by one — one warm-up microbatch less on that stage — from the last
    but one stage back to stage 0 (the later stages' warm-up decides more of the bubble).
    Caps below one in-flight microbatch are skipped."""
    cap_name = desc[0]
    base = problems[cap_name].memory_limit or problem.memory_limit
    if base is None:
        return
    for s in range(problem.num_stages - 2, -1, -1):
        c = math.floor(base[s] + 1e-9) - 1
        if c < 1:
            continue
        vec = tuple(float(c) if r == s else float(x) for r, x in enumerate(base))
        try:
            prob_n = problem.with_memory_limit(vec)
        except ValueError:
            continue
        yield f"{cap_name}/s{s}-1", prob_n, desc


def plan_crosspipe_problem(
    problem: CrossPipeProblem,
    variant: str = "ud",
    n_sub: int | Iterable[int] | None = None,
    steady: str | Iterable[str] | None = None,
    reserve: str | int | Iterable[str | int] | None = None,
    lookahead: bool | Iterable[bool] | None = None,
    caps: Mapping[str, Sequence[float]] | None = None,
    portfolio: bool = True,
    convert: bool = True,
    budget: float | None = DEFAULT_BUDGET,
    time_budget_ms: float | None = None,
    extra: Mapping[str, Mapping[int, Sequence[Op]]] | None = None,
    search: bool = True,
    engine: bool = True,
) -> CrossPipePlan:
    """CrossUD (``n_sub = 1``), CrossUDSub (``n_sub`` > 1) or CrossWave (V-shape problem) plan.

    ``portfolio=False``: one run of Alg.1 as the paper states it — steady phase interleaving F and D,
    no lookahead, the memory limit as the only cap; ``n_sub`` = 1 (CrossUD) or 2 (CrossUDSub), V-turn
    reserve 1 (CrossWave); no local search.

    ``portfolio=True`` (default): parameters left at None form a portfolio (CrossPipe §6.2: "a schedule
    with the best simulation performance is selected"): steady ∈ {interleave, backward_first} ×
    lookahead ∈ {off, on} × the per-rank in-flight caps in ``caps`` (name → per-rank limit, each
    clipped to the memory limit; the memory limit alone is always one member) × n_sub ∈ {1, 2, 4}
    (CrossUDSub) × V-turn reserve ∈ {1, 2, 4, "pending"} (CrossWave), tried in a fixed priority order
    (``_UD_PRIORITY`` first).  ``extra`` adds ready-made orders as members (name → rank → ops; e.g.
    torch's ZBV for CrossWave; a member above the memory limit or one that deadlocks is skipped).
    On UD problems with at most ``_NEIGHBOUR_MAX_STAGES`` stages, the best member's *cap neighbours*
    (:func:`_cap_neighbours`: its per-stage in-flight caps with one stage lowered by one, i.e. one
    warm-up microbatch less there) are members too, on ``_NEIGHBOUR_SHARE`` · budget of extra work;
    there the members get ``_SMALL_MEMBER_SHARE`` of the budget.
    Then the best member is improved by :func:`_local_search` (``search=True``): moves of single
    operations around the critical path, kept when the replayed makespan drops and memory stays
    within the limit (the best cap neighbour is searched first when it is within ``_NEIGHBOUR_FIRST``
    of the best member).

    ``budget`` (operations replayed, see ``DEFAULT_BUDGET``) bounds the work: members are generated in
    priority order while at most half the budget is spent (always at least one), the local search gets
    the rest.  The result is deterministic for a given budget.  ``budget=None``: every member, then
    the local search until no move improves.  ``time_budget_ms`` additionally stops both phases at a
    wall-clock deadline (not deterministic; off by default).

    ``engine=True`` (default): where the compiled modules are built (``_compiled()``), the portfolio
    and search run on them instead (:func:`_plan_compiled`: more members, descents and annealing for
    the same budget; a different, also deterministic, plan); ``engine=False`` forces the Python path.
    """
    t0 = time.perf_counter()
    deadline = None if time_budget_ms is None else t0 + time_budget_ms / 1e3
    if variant not in CROSSPIPE_VARIANTS:
        raise ValueError(f"variant must be one of {CROSSPIPE_VARIANTS}, got {variant!r}")
    wave_shape = any(problem.stage_to_rank.count(r) > 1 for r in range(problem.num_ranks))
    if variant == "wave" and not wave_shape:
        raise ValueError("variant 'wave' needs a V-shape problem (two stages per rank)")
    if variant in ("ud", "udsub") and wave_shape:
        raise ValueError(f"variant {variant!r} needs one stage per rank")

    def as_tuple(v, default):
        if v is None:
            return default
        if isinstance(v, (str, int)):
            return (v,)
        return tuple(v)

    if portfolio:
        subs = as_tuple(n_sub, {"ud": (1,), "udsub": (1, 2, 4), "wave": (1,)}[variant])
        steadies = as_tuple(steady, ("interleave", "backward_first"))
        reserves = as_tuple(reserve, (1, 2, 4, "pending") if variant == "wave" else (1,))
        lookaheads = (lookahead,) if isinstance(lookahead, bool) else as_tuple(lookahead, (False, True))
    else:
        subs = as_tuple(n_sub, {"ud": (1,), "udsub": (2,), "wave": (1,)}[variant])
        steadies = as_tuple(steady, ("interleave",))
        reserves = as_tuple(reserve, (1,))
        lookaheads = (lookahead,) if isinstance(lookahead, bool) else as_tuple(lookahead, (False,))
    if variant == "ud" and subs != (1,):
        raise ValueError("CrossUD is the n_sub = 1 variant; use 'udsub' for sub-blocks")
    problems = {"limit": problem}
    if portfolio and caps:
        base = problem.memory_limit or (math.inf,) * problem.num_ranks
        for name, cap in caps.items():
            if len(cap) != problem.num_ranks:
                raise ValueError(f"caps[{name!r}] has {len(cap)} entries, expected one per rank ({problem.num_ranks})")
            limit = tuple(float(min(b, c)) for b, c in zip(base, cap))
            if limit != problem.memory_limit and all(limit != p.memory_limit for p in problems.values()):
                try:
                    problems[name] = problem.with_memory_limit(limit)
                except ValueError:  # a cap below one microbatch per stage: not a usable member
                    pass
    members = [(c, ns, rs, st, la) for c in problems for ns in subs for rs in reserves for st in steadies
               for la in lookaheads]
    prio = {m: i for i, m in enumerate(_WAVE_PRIORITY if variant == "wave" else _UD_PRIORITY)}
    members.sort(key=lambda x: prio.get((x[0], x[1], x[3], x[2], x[4]), len(prio)))  # stable: product order after
    if portfolio and search and engine and _compiled():
        return _plan_compiled(problem, variant, problems, members, subs, steadies, budget, extra, t0, deadline,
                              convert)
    unlimited = budget is None or not portfolio
    budget = math.inf if budget is None else float(budget)
    model = _Model(problem)
    limit = problem.memory_limit or (math.inf,) * problem.num_ranks
    steps = 3 * problem.num_microbatches * problem.num_stages
    greedy_units = 0

    def used() -> float:
        return greedy_units + model.work

    small = portfolio and variant != "wave" and problem.num_stages <= _NEIGHBOUR_MAX_STAGES
    share = _SMALL_MEMBER_SHARE if small else _MEMBER_SHARE
    pool = []  # (makespan, order in pool, member description, GreedyResult | None, ids)
    error: ValueError | None = None
    tried = []
    for cap_name, ns, rs, st, la in members:
        cost = GREEDY_COST * (steps + (ns - 1) * problem.num_microbatches * problem.num_stages) + model.n
        if len(tried) >= max(1, _MIN_MEMBERS.get(variant, 0)) and not unlimited and (used() + cost > budget * share or
                                       (deadline is not None and time.perf_counter() > deadline)):
            break
        if len(tried) >= _MIN_MEMBERS.get(variant, 0):  # the always-generated members are not charged
            greedy_units += cost - model.n
        else:
            greedy_units -= model.n
        try:
            g = greedy_schedule(problems[cap_name], ns, st, rs, lookahead=la)
        except ValueError as e:  # this member's memory rule admits no schedule
            tried.append((cap_name, ns, st, rs, la, math.inf))
            error = e
            continue
        ids = model.ids(g.orders)
        mk = model.run(ids)[0]
        tried.append((cap_name, ns, st, rs, la, mk))
        if mk < math.inf:
            pool.append((mk, len(pool), (cap_name, ns, st, rs, la), g, ids))
    neighbour_names: set[str] = set()
    if small and pool:
        # cap neighbours (our addition): the best member's in-flight caps with one stage lowered by one
        # (its warm-up count; B2's optimum keeps stage 2 one microbatch shorter than every member),
        # same n_sub / steady / lookahead; charged, on a budget of their own (_NEIGHBOUR_SHARE)
        done_keys = {(problems[c].memory_limit, ns_, st_, la_) for c, ns_, st_, _, la_, _ in tried}
        extra_work = math.inf if unlimited else _NEIGHBOUR_SHARE * budget
        nb_budget = used() + extra_work
        if not unlimited:
            budget += extra_work
        for name, prob_n, desc in _cap_neighbours(problem, problems, min(pool, key=lambda x: (x[0], x[1]))[2]):
            ns_, st_, la_ = desc[1], desc[2], desc[4]
            key = (prob_n.memory_limit, ns_, st_, la_)
            if key in done_keys:
                continue
            done_keys.add(key)
            cost = GREEDY_COST * (steps + (ns_ - 1) * problem.num_microbatches * problem.num_stages) + model.n
            if used() + cost > nb_budget or (deadline is not None and time.perf_counter() > deadline):
                break
            greedy_units += cost - model.n
            try:
                g = greedy_schedule(prob_n, ns_, st_, desc[3], lookahead=la_)
            except ValueError:
                continue
            ids = model.ids(g.orders)
            mk = model.run(ids)[0]
            tried.append((name, ns_, st_, desc[3], la_, mk))
            if mk < math.inf:
                pool.append((mk, len(pool), (name, ns_, st_, desc[3], la_), g, ids))
                neighbour_names.add(name)
    for name, orders in (extra or {}).items():
        if any(r not in orders for r in range(problem.num_ranks)):
            continue
        if any(pk > lim + 1e-9 for pk, lim in zip(peak_memory(problem, orders), limit)):
            continue
        ids = model.ids(orders)
        mk = model.run(ids)[0]
        tried.append((name, 0, "", 0, False, mk))
        if mk < math.inf:
            pool.append((mk, len(pool), (name, 0, "", 0, False), None, ids))
    if not pool:
        raise error
    pool.sort(key=lambda x: (x[0], x[1]))
    mk, _, (cap_name, ns, st, rs, la), g, ids = pool[0]
    greedy_mk = g.makespan_ms if g is not None else mk
    improved = False
    if portfolio and search:
        # local search from the best members in turn while the budget lasts (distinct makespans only;
        # a close cap neighbour first)
        seen_mk = set()
        starts = pool[:_MAX_STARTS]
        nb = [x for x in pool if x[2][0] in neighbour_names]
        if nb and nb[0][0] <= pool[0][0] * (1 + _NEIGHBOUR_FIRST):
            # the best cap neighbour first when it is close: its warm-up is one the members' search
            # does not reach (B1: 506.2 → 486.9 vs 493.2 → 490.2 from the best member)
            starts = [nb[0]] + [x for x in pool if x is not nb[0]][:_MAX_STARTS - 1]
        for mk0, _, desc, g0, ids0 in starts:
            key = round(mk0, 6)
            if key in seen_mk:
                continue
            seen_mk.add(key)
            left = budget - used()
            if seen_mk and len(seen_mk) > 1 and (left < model.n * 8 or
                                                 (deadline is not None and time.perf_counter() > deadline)):
                break
            ids1, mk1, _ = _local_search(model, [list(o) for o in ids0], limit, left, depth=_DEPTH, deadline=deadline)
            if mk1 < mk - 1e-9:
                mk, ids, improved = mk1, ids1, True
                cap_name, ns, st, rs, la = desc
                g = g0
                greedy_mk = g0.makespan_ms if g0 is not None else mk0
    orders = model.ops(ids) if (improved or g is None) else g.orders
    actions = to_actions(orders) if convert else {}
    return CrossPipePlan(
        actions=actions,
        orders=orders,
        stage_to_rank=problem.stage_to_rank,
        variant=variant,
        n_sub=ns,
        steady=st,
        reserve=rs,
        lookahead=la,
        caps=cap_name,
        makespan_ms=mk,
        greedy_makespan_ms=greedy_mk,
        memory_limit=problem.memory_limit,
        peak_memory=peak_memory(problem, orders),
        plan_ms=(time.perf_counter() - t0) * 1e3,
        candidates=tried,
        improved=improved,
    )


# ----------------------------------------------------------------------------- profile boundary
def problem_from_profile(
    profile,
    variant: str = "ud",
    memory_limit: int | float | Sequence[float] | None = None,
    memory_deltas: tuple[float, float, float] = (1.0, -1.0, 0.0),
) -> CrossPipeProblem:
    """Build the generator's problem from a :class:`titan_ext.plan.PipelineProfile`.

    ``variant`` "ud"/"udsub": one stage per rank.  "wave": the profile describes the 2R model chunks
    (``num_stages`` even), placed V-shape (stages s and 2R−1−s on rank s, as torch's ZBV).
    ``memory_limit``: per-rank limit on in-flight activations (one number for all ranks or one per
    rank); None → the profile's memory budget (``max_inflight()``, summed over a rank's stages) or
    unlimited when the profile has none.
    """
    S = profile.num_stages
    if variant == "wave":
        if S % 2:
            raise ValueError(f"crosspipe-wave needs an even number of stages (two chunks per rank), got {S}")
        stage_to_rank = wave_stage_to_rank(S // 2)
    elif variant in ("ud", "udsub"):
        stage_to_rank = tuple(range(S))
    else:
        raise ValueError(f"variant must be one of {CROSSPIPE_VARIANTS}, got {variant!r}")
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
        memory_deltas=memory_deltas,
    )


def _warmup_caps(profile, problem: CrossPipeProblem) -> dict[str, list[float]]:
    """Per-stage in-flight caps from PipeMorph's warm-up planning (Alg.1 under the memory limit; Alg.2
    from the profile's delays with slack floor 2 and 1), used as extra portfolio members of the UD
    variants: the greedy then decides the order, the caps how far each stage may run ahead."""
    from .warmup import adapted_warmup_counts, initial_warmup_counts_for

    limit = problem.memory_limit
    scalar = None if limit is None else int(math.floor(max(limit) + 1e-9))  # then clipped per rank
    out: dict[str, list[float]] = {}
    for name, fn in (
        ("alg1", lambda: initial_warmup_counts_for(profile, scalar)),
        ("alg2", lambda: adapted_warmup_counts(profile, slack_floor=2, memory_limit=scalar)),
        ("alg2-floor1", lambda: adapted_warmup_counts(profile, slack_floor=1, memory_limit=scalar)),
    ):
        try:
            out[name] = [float(x) for x in fn()]
        except ValueError:
            continue
    return out


@functools.lru_cache(maxsize=32)
def _zbv_orders(num_ranks: int, num_microbatches: int) -> dict[int, tuple[Op, ...]] | None:
    """torch's ZBV (ScheduleZBVZeroBubble) compute order as plain tuples, V-shape placement; None when
    torch cannot provide it.  Imported lazily: plan/ stays torch-free at import time."""
    try:
        from .builtin import builtin_plan
        from .ir import as_ops

        plan, s2r = builtin_plan("ZBVZeroBubble", num_ranks, num_microbatches)
    except Exception:  # noqa: BLE001 - torch missing or this (R, N) unsupported by torch: no member
        return None
    if [s2r[s] for s in range(2 * num_ranks)] != list(wave_stage_to_rank(num_ranks)):
        return None
    ops = as_ops(plan)
    if any(k not in (F, I, W) for o in ops.values() for _, k, _ in o):
        return None
    return {r: tuple(tuple(x) for x in o) for r, o in ops.items()}


def plan_crosspipe(
    profile,
    variant: str = "ud",
    *,
    memory_limit: int | float | Sequence[float] | None = None,
    n_sub: int | Iterable[int] | None = None,
    steady: str | Iterable[str] | None = None,
    reserve: str | int | Iterable[str | int] | None = None,
    lookahead: bool | Iterable[bool] | None = None,
    portfolio: bool = True,
    validate: bool = True,
    budget: float | None = DEFAULT_BUDGET,
    time_budget_ms: float | None = None,
    zbv: bool = True,
) -> CrossPipePlan:
    """CrossPipe greedy plan (§4.2) for a :class:`~titan_ext.plan.PipelineProfile`.

    ``variant``: "ud" (CrossUD, whole blocks), "udsub" (CrossUDSub, W split into ``n_sub``
    sub-blocks) or "wave" (CrossWave, V-shape over the profile's 2R chunks).  ``memory_limit``: per-rank
    in-flight activation limit (see :func:`problem_from_profile`).  ``budget`` / ``time_budget_ms``: see
    :func:`plan_crosspipe_problem`.  ``zbv`` (CrossWave): torch's ZBV order is one more portfolio member
    (when it fits the memory limit), so CrossWave is never slower than ZBV at ZBV's memory (the order
    comes from torch, imported lazily; skipped when torch is unavailable).  The returned plan has passed
    :func:`titan_ext.plan.validate_plan` (torch lowering + dry run included) unless ``validate=False``.
    """
    t0 = time.perf_counter()
    problem = problem_from_profile(profile, variant, memory_limit)
    caps = None
    extra = None
    if portfolio and variant != "wave":
        caps = _warmup_caps(profile, problem)
    if portfolio and variant == "wave" and zbv:
        order = _zbv_orders(problem.num_ranks, problem.num_microbatches)
        if order is not None:
            extra = {"zbv": order}
    plan = plan_crosspipe_problem(problem, variant, n_sub=n_sub, steady=steady, reserve=reserve,
                                  lookahead=lookahead, caps=caps, portfolio=portfolio, budget=budget,
                                  time_budget_ms=time_budget_ms, extra=extra)
    if validate:
        from .validate import validate_plan

        per_stage = None
        if problem.memory_limit is not None and variant != "wave":
            per_stage = [int(math.floor(x + 1e-9)) for x in problem.memory_limit]
        validate_plan(plan.actions, problem.num_stages, problem.num_microbatches, inflight_limit=per_stage)
    plan.plan_ms = (time.perf_counter() - t0) * 1e3
    return plan


# ----------------------------------------------------------------------------- CLI / by-name entry
CROSSPIPE_SCHEDULES = ("crosspipe-ud", "crosspipe-udsub", "crosspipe-wave", "optimal")


def wave_profile(profile):
    """The V-shape (CrossWave / ZBV) version of a one-stage-per-rank profile: each rank's stage is cut
    into two chunks of half its F/B/W time (and activation size), chunk s and 2R−1−s on rank s; the
    link between rank i and i+1 (``profile.links[i]``) carries both stage boundaries that cross it."""
    from .profile import LinkProfile, PipelineProfile

    R = profile.num_stages
    s2r = wave_stage_to_rank(R)
    half = lambda values: tuple(values[s2r[s]] / 2 for s in range(2 * R))  # noqa: E731
    links = tuple(
        profile.links[min(s2r[b], s2r[b + 1])] if s2r[b] != s2r[b + 1] else LinkProfile() for b in range(2 * R - 1)
    )
    memory = {}
    if profile.activation_bytes is not None:
        memory = {"activation_bytes": half(profile.activation_bytes),
                  "memory_budget_bytes": tuple(profile.memory_budget_bytes[s2r[s]] / 2 for s in range(2 * R))}
    return PipelineProfile(2 * R, profile.num_microbatches, half(profile.f_ms), half(profile.b_ms),
                           half(profile.w_ms), links, **memory)


def plan_by_name(profile, name: str, memory_limit: int | None = None, time_limit_s: float = 60.0) -> tuple:
    """Plan ``name`` (one of ``CROSSPIPE_SCHEDULES``) for a one-stage-per-rank ``profile``.

    Returns ``(actions, sim_profile, stage_to_rank, info)``: the validated torch-IR plan, the profile to
    simulate it with (the V-shape profile of :func:`wave_profile` for crosspipe-wave), its stage→rank
    map and a JSON-able dict.  ``memory_limit`` K: in-flight activations per stage, in units of one
    stage's activation (for crosspipe-wave: K per rank, i.e. 2K half-size chunk activations).
    """
    if name not in CROSSPIPE_SCHEDULES:
        raise ValueError(f"schedule must be one of {CROSSPIPE_SCHEDULES}, got {name!r}")
    if name == "optimal":
        from .optimal import solve_optimal

        res = solve_optimal(profile, memory_limit=memory_limit, time_limit_s=time_limit_s)
        if res.actions is None:
            raise ValueError(f"the solver found no schedule within {time_limit_s} s (status {res.status})")
        info = {"solver_status": res.status, "proven_optimal": res.proven, "solver_makespan_ms": res.makespan_ms,
                "bound_ms": res.bound_ms, "plan_ms": round(res.solve_s * 1e3, 3), "time_unit_ms": res.time_unit_ms}
        return res.actions, profile, tuple(range(profile.num_stages)), info
    variant = name.split("-", 1)[1]
    sim_profile = profile
    limit = memory_limit
    if variant == "wave":
        sim_profile = wave_profile(profile)
        if memory_limit is not None:
            limit = 2 * memory_limit
    plan = plan_crosspipe(sim_profile, variant, memory_limit=limit)
    info = {"n_sub": plan.n_sub, "steady": plan.steady, "reserve": plan.reserve, "lookahead": plan.lookahead,
            "caps": plan.caps, "local_search_improved": plan.improved,
            "predicted_makespan_ms": plan.makespan_ms, "plan_ms": round(plan.plan_ms, 3),
            "peak_memory_per_rank": plan.peak_memory}
    return plan.actions, sim_profile, plan.stage_to_rank, info
