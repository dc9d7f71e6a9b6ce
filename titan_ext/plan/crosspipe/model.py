"""The timing model of CrossPipe §3.5 on flat arrays: fast repeated evaluation of fixed per-rank
whole-action orders (the portfolio's selection by simulation, §6.2, the local search) and
:func:`replay`, which times a plan given as ``(stage, kind, microbatch)`` orders.

Operation id ``(3·stage + kind)·N + microbatch`` (kind 0 F, 1 I, 2 W).  ``_search.c`` is the compiled
copy of :meth:`Model.run` / :meth:`Model.rerun` (bit-identical; tests/plan/test_crosspipe_engine.py).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

from ..deps import table
from .greedy import GreedyResult
from .problem import KINDS, CrossPipeProblem, Op


class Edge(NamedTuple):
    """What an operation's end makes available: operation ``op`` once the message has arrived."""

    op: int
    channel: int
    """index of the (src rank, dst rank) channel the message uses; −1: same-rank dependency."""
    transfer_ms: float
    """size·β: how long the message occupies its channel."""
    latency_ms: float
    """α (pipelined: does not occupy the channel)."""


_LOCAL = (-1, 0.0, 0.0)


def _edges(problem: CrossPipeProblem) -> tuple[list[float], list[tuple[Edge, ...]], int]:
    """(duration per operation id, its out-edges, number of channels): ``deps.table``'s rule (CrossPipe
    §3.5's — F(s) → F(s+1); F(S−1) → I(S−1); I(s) → W(s) and I(s−1)) on operation ids: the out-edges of
    op (q, m) go to (c, m) for every class c that class q feeds."""
    N, S = problem.num_microbatches, problem.num_stages
    deps = table(S)
    chans: dict[tuple[int, int], int] = {}

    def hop(a: int, b: int) -> tuple[int, float, float]:
        h = problem.hop(a, b)
        if h is None:
            return _LOCAL
        return (chans.setdefault(h.channel, len(chans)), h.transfer_ms, h.latency_ms)

    dur: list[float] = []
    out: list[tuple[Edge, ...]] = []
    for s in range(S):
        for k, t in enumerate((problem.f_ms[s], problem.b_ms[s], problem.w_ms[s])):
            dur.extend([t] * N)
            to = [(c, _LOCAL if c // 3 == s else hop(s, c // 3)) for c in deps.feeds_of(3 * s + k)]
            out.extend(tuple(Edge(c * N + m, *h) for c, h in to) for m in range(N))
    return dur, out, len(chans)


class Model:
    """The timing model of CrossPipe §3.5 compiled to flat arrays, for fast repeated evaluation of
    fixed per-rank orders (the portfolio's selection by simulation, §6.2, and the local search).

    Operation id ``(3·stage + kind)·N + microbatch`` (kind 0 F, 1 I, 2 W); ``out[id]`` lists the
    operation's :class:`Edge` s.  Every message on a channel is sent by one rank in its program order,
    so a FIFO per channel gives exactly the range-based occupancy of §4.2.3 here (see :func:`replay`).
    """

    __slots__ = ("N", "S", "R", "n", "dur", "out", "rank", "kind", "delta", "nch", "stage_to_rank", "prod", "chan_of",
                 "chan_sender", "cons", "tx_chans", "work", "_no_tail")

    def __init__(self, problem: CrossPipeProblem) -> None:
        N, S, R = problem.num_microbatches, problem.num_stages, problem.num_ranks
        s2r = problem.stage_to_rank
        self.N, self.S, self.R, self.n = N, S, R, 3 * N * S
        n = self.n
        self.stage_to_rank = s2r
        self.dur, self.out, self.nch = _edges(problem)
        self.rank = [s2r[i // (3 * N)] for i in range(n)]
        self.kind = [(i // N) % 3 for i in range(n)]
        self.delta = tuple(problem.memory_deltas)
        self.work = 0
        """operations simulated so far by run/rerun (plus a fixed 4R + 32 per call): the deterministic
        cost measure of the local search's budget."""
        self._no_tail = [0.0] * n
        self.prod = [n] * n  # each operation's trigger (deps.table; n: none, stage 0's F)
        self.chan_of = [-1] * n  # channel an operation's message occupies (-1: none or size·β = 0)
        self.chan_sender = [0] * self.nch
        self.cons = [tuple(e.op for e in self.out[o]) for o in range(n)]
        for o in range(n):
            for d, ch, tx, _ in self.out[o]:
                self.prod[d] = o
                if ch >= 0:
                    self.chan_sender[ch] = self.rank[o]
                    if tx:
                        self.chan_of[o] = ch
        self.tx_chans = sorted({ch for ch in self.chan_of if ch >= 0})

    def ids(self, orders: Mapping[int, Sequence[Op]]) -> list[list[int]]:
        """Per-rank ``(stage, kind, microbatch)`` orders → operation ids."""
        N, kid = self.N, {k: i for i, k in enumerate(KINDS)}
        return [[(3 * s + kid[k]) * N + m for s, k, m in orders[r]] for r in range(self.R)]

    def ops(self, ids: Sequence[Sequence[int]]) -> dict[int, list[Op]]:
        """Per-rank operation ids → ``(stage, kind, microbatch)`` orders."""
        N = self.N
        return {r: [(i // (3 * N), KINDS[(i // N) % 3], i % N) for i in o] for r, o in enumerate(ids)}

    def run(self, orders: Sequence[Sequence[int]], detail: bool = False, bound: float = math.inf,
            tail: Sequence[float] | None = None):
        """Time per-rank id orders.  Returns (makespan, Σ rank finish times) — inf if they deadlock or
        if some operation ends after ``bound`` (or, with ``tail``, see :meth:`rerun`, its end plus its
        rank's remaining work does) — or with ``detail`` a :class:`Timed` (the state :meth:`rerun`
        restarts from)."""
        N, R = self.N, self.R
        avail = [-1.0] * self.n
        avail[:N] = [0.0] * N
        return self._loop(orders, avail, [0] * R, [0.0] * R, [0.0] * self.nch, 0, detail, bound, None,
                          tail=None if detail else tail)

    def spec(self) -> tuple:
        """The model as plain tuples for the compiled engine (``_search.c``)."""
        return (self.N, self.R, self.nch, self.dur, self.out, self.rank, self.kind, self.prod, self.delta)

    def rerun(self, orders: Sequence[Sequence[int]], base: "Timed", r: int, lo: int, hi: int,
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
            return Timed(mk, sum(free) if mk < math.inf else math.inf, start, avail, pos, msgres, rank_starts)
        if done != self.n:
            return math.inf, math.inf
        return max(free) - first, sum(free)


@dataclass
class Timed:
    """Detailed result of :meth:`Model.run`."""

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


def _check_complete(problem: CrossPipeProblem, orders: Mapping[int, Sequence[Op]]) -> None:
    """Every operation exactly once, each on its stage's rank (ValueError otherwise)."""
    s2r = problem.stage_to_rank
    expected = 3 * problem.num_microbatches * problem.num_stages
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


def replay(problem: CrossPipeProblem, orders: Mapping[int, Sequence[Op]]) -> GreedyResult:
    """Time fixed per-rank whole-action orders with the same model (CrossPipe §3.5): each action
    starts when its rank is free and its input (``deps.table``) has arrived; messages queue FIFO per
    link direction (``timing.LinkQueues``, written inline in :meth:`Model._loop`'s inner loop).

    Every message on a link direction is sent by the same rank (the one on its near side), in that
    rank's program order, so ready times per direction are non-decreasing whatever order ranks are
    advanced in: a work list suffices and a FIFO per direction equals the range-based reservation of
    a chronological run.  Implemented on :class:`Model` (flat arrays; also the portfolio's and the
    local search's evaluator).

    Raises ValueError if the orders deadlock or miss/duplicate an action.
    """
    _check_complete(problem, orders)
    R = problem.num_ranks
    model = Model(problem)
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
