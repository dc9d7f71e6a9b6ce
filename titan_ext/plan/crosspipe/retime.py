"""``simulate``'s timing model (CrossPipe §3.5, DESIGN.md "Timing model", delegated mode) on flat arrays,
for the portfolio's selection by simulation (§6.2) and the local search's fast repeated and incremental
re-timing of fixed per-rank whole-action orders: :class:`Retimer`.

Not a model of its own: it reads the one description (:class:`~titan_ext.plan.placed.PlacedProfile`:
times in integer ns, ``deps.table``'s rule, one FIFO per rank direction as ``timing.LinkQueues``) and
returns ``simulate``'s makespan bit for bit (tests/plan/test_plan_reference.py).  ``_search.c`` is its
compiled copy (bit-identical; tests/plan/test_crosspipe_engine.py).

Operation id ``(3·stage + kind)·N + microbatch`` (kind 0 F, 1 I, 2 W).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

from ..deps import table
from ..placed import PlacedProfile
from .variants import KINDS, Op


class Edge(NamedTuple):
    """What an operation's end makes available: operation ``op`` once the message has arrived."""

    op: int
    channel: int
    """index of the (src rank, dst rank) channel the message uses; −1: same-rank dependency."""
    transfer: int
    """size·β (time units, ns unless ``unit_ns``): how long the message occupies its channel."""
    latency: int
    """α (pipelined: does not occupy the channel)."""


_LOCAL = (-1, 0, 0)


def _edges(placed: PlacedProfile, unit_ns: int) -> tuple[list[int], list[tuple[Edge, ...]], int]:
    """(duration per operation id, its out-edges, number of channels): ``deps.table``'s rule (CrossPipe
    §3.5's — F(s) → F(s+1); F(S−1) → I(S−1); I(s) → W(s) and I(s−1)) on operation ids: the out-edges of
    op (q, m) go to (c, m) for every class c that class q feeds."""
    N, S = placed.num_microbatches, placed.num_stages
    deps = table(S)
    chans: dict[tuple[int, int], int] = {}
    q = (lambda ns: ns) if unit_ns == 1 else (lambda ns: int(round(ns / unit_ns)))

    def hop(a: int, b: int) -> tuple[int, int, int]:
        h = placed.channel(a, b)
        if h is None:
            return _LOCAL
        lat, tx = placed.link_ns(h[0])
        return (chans.setdefault(h[1], len(chans)), q(tx), q(lat))

    dur: list[int] = []
    out: list[tuple[Edge, ...]] = []
    for s in range(S):
        for k, times in enumerate(placed.times_ns()):
            dur.extend([q(times[s])] * N)
            to = [(c, _LOCAL if c // 3 == s else hop(s, c // 3)) for c in deps.feeds_of(3 * s + k)]
            out.extend(tuple(Edge(c * N + m, *h) for c, h in to) for m in range(N))
    return dur, out, len(chans)


class Retimer:
    """``simulate``'s model compiled to flat arrays, for fast repeated evaluation of fixed per-rank orders
    (the portfolio's selection by simulation, §6.2, and the local search).

    Operation id ``(3·stage + kind)·N + microbatch`` (kind 0 F, 1 I, 2 W); ``out[id]`` lists the
    operation's :class:`Edge` s.  Every message on a channel is sent by one rank in its program order,
    so whatever order the ranks are advanced in, a FIFO per channel sees the messages in ``simulate``'s
    order (and equals §4.2.3's range-based occupancy here).  Times in integer ns (``unit_ns`` > 1: in
    units of that many ns, each time rounded: the CP-SAT solver's grid).  The makespan is the end of the
    last operation (time starts at 0 with the first F of stage 0), ``simulate``'s."""

    __slots__ = ("N", "S", "R", "n", "dur", "out", "rank", "kind", "delta", "nch", "stage_to_rank", "prod", "chan_of",
                 "chan_sender", "cons", "tx_chans", "work", "_no_tail")

    def __init__(self, placed: PlacedProfile, unit_ns: int = 1) -> None:
        N, S, R = placed.num_microbatches, placed.num_stages, placed.num_ranks
        s2r = placed.stage_to_rank
        self.N, self.S, self.R, self.n = N, S, R, 3 * N * S
        n = self.n
        self.stage_to_rank = s2r
        self.dur, self.out, self.nch = _edges(placed, unit_ns)
        self.rank = [s2r[i // (3 * N)] for i in range(n)]
        self.kind = [(i // N) % 3 for i in range(n)]
        self.delta = tuple(float(x) for x in placed.memory_deltas)
        self.work = 0
        """operations simulated so far by run/rerun (plus a fixed 4R + 32 per call): the deterministic
        cost measure of the local search's budget."""
        self._no_tail = [0] * n
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
            tail: Sequence[int] | None = None):
        """Time per-rank id orders.  Returns (makespan, Σ rank finish times) — inf if they deadlock or
        if some operation ends after ``bound`` (or, with ``tail``, see :meth:`rerun`, its end plus its
        rank's remaining work does) — or with ``detail`` a :class:`Timed` (the state :meth:`rerun`
        restarts from)."""
        N, R = self.N, self.R
        avail = [-1] * self.n
        avail[:N] = [0] * N
        return self._loop(orders, avail, [0] * R, [0] * R, [0] * self.nch, 0, detail, bound,
                          tail=None if detail else tail)

    def spec(self) -> tuple:
        """The model as plain tuples for the compiled engine (``_search.c``)."""
        return (self.N, self.R, self.nch, self.dur, self.out, self.rank, self.kind, self.prod, self.delta)

    def rerun(self, orders: Sequence[Sequence[int]], base: "Timed", r: int, lo: int, hi: int,
              bound: float = math.inf, detail: bool = False, tail: Sequence[int] | None = None):
        """Time ``orders``, which differ from the timed ``base`` only on rank ``r`` at positions lo..hi:
        every operation that started before the earliest of those (in ``base``) keeps its times (it
        cannot depend on them), so the run restarts from that point.  Same result as :meth:`run`.
        ``tail`` (per operation id: the total duration of the operations after it on its rank, see
        :func:`.search.rank_tails`; only without ``detail``) aborts the run as soon as an operation's end
        plus its rank's remaining work exceeds ``bound`` (that run's makespan would exceed it too)."""
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
        free = [0] * R
        for x in range(R):
            k = pos[x]
            if k:
                o = orders[x][k - 1]
                free[x] = st[o] + dur[o]
        chfree = [0] * self.nch
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
                    avail[d] = -1
        if detail:
            return self._loop(orders, avail, pos, free, chfree, sum(pos), True, bound,
                              base.start[:], base.msgres[:], base.rank_starts)
        return self._loop(orders, avail, pos, free, chfree, sum(pos), False, bound, tail=tail)

    def _loop(self, orders, avail, pos, free, chfree, done, detail, bound, start=None, msgres=None,
              base_starts=None, tail=None):
        dur, out, rank = self.dur, self.out, self.rank
        if tail is None:
            tail = self._no_tail
        R = self.R
        if detail and start is None:
            start = [0] * self.n + [-1]  # start[n]: the "producer" of stage 0's F (see prod)
            msgres = [0] * self.n
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
                fr = t + dur[o]
                if fr + tail[o] > bound:
                    self.work += done + p - p0 - done0
                    return math.inf, math.inf
                for d, ch, tx, lat in out[o]:
                    if ch < 0:
                        avail[d] = fr
                    elif tx:  # timing.LinkQueues.send, inline (this is the inner loop)
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
            mk = max(free) if done == self.n else math.inf
            if base_starts is None:
                rank_starts = [[start[x] for x in o] for o in orders]
            else:
                self.work += 2 * R
                rank_starts = [base_starts[x][:k] + [start[y] for y in orders[x][k:]] for x, k in enumerate(pos0)]
            return Timed(mk, sum(free) if mk < math.inf else math.inf, start, avail, pos, msgres, rank_starts)
        if done != self.n:
            return math.inf, math.inf
        return max(free), sum(free)


@dataclass
class Timed:
    """Detailed result of :meth:`Retimer.run`."""

    makespan: int | float
    """the end of the last operation (math.inf: deadlock)."""
    finish_sum: int | float
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
