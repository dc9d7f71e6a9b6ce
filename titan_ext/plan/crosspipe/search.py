"""Local search on whole-action orders (our addition to CrossPipe's Alg.1; §6.2's selection by
simulation applied to single moves): the critical-path descent and simulated annealing.

These are the pure-Python references of ``_search.c``'s ``descent`` and ``anneal`` (same plans for the
same evaluation counts; tests/plan/test_crosspipe_engine.py); the planner runs the compiled ones where
they are built.  Every candidate is timed by :class:`.retime.Retimer` (``simulate``'s model on flat
arrays, integer ns: comparisons are exact).
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple, Sequence

from .retime import Retimer


class Move(NamedTuple):
    """Move the operation at position ``src`` of ``rank``'s order to position ``dst``."""

    rank: int
    src: int
    dst: int


class _Path:
    """Collects the moves of :func:`critical_moves` (no duplicates, in discovery order)."""

    def __init__(self, model: Retimer, ids: list[list[int]], start: list[int], avail: list[int], depth: int):
        self.model, self.ids, self.start, self.avail, self.depth = model, ids, start, avail, depth
        self.moves: list[Move] = []
        self.seen: set[tuple[int, int, int]] = set()

    def add(self, r: int, p: int, q: int) -> None:
        if (r, p, q) not in self.seen:
            self.seen.add((r, p, q))
            self.moves.append(Move(r, p, q))

    def rank_bound(self, r: int, p: int, long_moves: int) -> None:
        """``o[p]`` waited for its rank: run it up to ``depth`` earlier (while it could start before
        the operation it jumps), its rank predecessor up to ``depth`` later, and (``long_moves``) that
        predecessor as late as microbatch order allows."""
        o, N, depth, start, dur = self.ids[r], self.model.N, self.depth, self.start, self.model.dur
        cur, prev = o[p], o[p - 1]
        q = p - 1
        while q >= 0 and p - q <= depth:
            a = o[q]
            if a // N == cur // N or self.avail[cur] >= start[a] + dur[a]:
                break
            self.add(r, p, q)
            q -= 1
        pcls = prev // N
        for q in range(p, min(len(o), p - 1 + depth)):
            if o[q] // N == pcls:
                break
            if q != p:
                self.add(r, p - 1, q)
        if long_moves == 2 or (long_moves == 1 and self.model.kind[prev] == 2):
            q = p
            while q < len(o) and o[q] // N != pcls:
                q += 1
            if q - 1 >= p - 1 + depth:
                # defer as far as microbatch order allows: just before its stage's next op of its kind
                self.add(r, p - 1, q - 1)

    def gap_fill(self, r: int, p: int) -> None:
        """The rank idled before ``o[p]``: run a later operation in that gap instead — the first one of
        each other stage and kind after it (microbatch order) whose input was there before it started,
        nearest first (a bottleneck rank must not idle while it has W's to do)."""
        o, N = self.ids[r], self.model.N
        cur = o[p]
        cls, found = cur // N, set()
        for j in range(p + 1, min(len(o), p + 1 + 4 * self.depth)):
            y = o[j]
            ycls = y // N
            if ycls in found or ycls == cls:
                continue
            found.add(ycls)
            if self.avail[y] < self.start[cur]:
                self.add(r, j, p)


def critical_moves(model: Retimer, ids: list[list[int]], start: list[int], avail: list[int], depth: int,
                   long_moves: int = 0, gap_fill: bool = False) -> list[Move]:
    """Candidate moves around the critical path of a timed plan.

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
    dur, rank = model.dur, model.rank
    model.work += 8 * model.R  # counted in the local search's budget
    path = _Path(model, ids, start, avail, depth)
    # the last-ending operation: the last one of some rank
    cur = max((o[-1] for o in ids if o), key=lambda i: start[i] + dur[i])
    while cur is not None:
        r = rank[cur]
        o = ids[r]
        p = o.index(cur)
        model.work += 4
        prev = o[p - 1] if p > 0 else -1
        if p > 0 and start[cur] <= start[prev] + dur[prev] and avail[cur] < start[cur]:
            path.rank_bound(r, p, long_moves)
            cur = prev
            continue
        # input-bound (or the first operation): follow the producer
        if gap_fill and p > 0 and start[cur] > start[prev] + dur[prev]:
            path.gap_fill(r, p)
        cur = model.prod[cur]  # its trigger (deps.table), n: none
        if cur >= model.n:
            cur = None
    return path.moves


def move_op(o: list, p: int, q: int) -> None:
    o.insert(q, o.pop(p))


def rank_tails(model: Retimer, ids: Sequence[Sequence[int]]) -> list[int]:
    """Per operation id: the total duration of the operations after it in its rank's order (a lower
    bound on how long its rank still runs once it ends)."""
    dur = model.dur
    tail = [0] * model.n
    for o in ids:
        acc = 0
        for x in reversed(o):
            tail[x] = acc
            acc += dur[x]
    return tail


def update_tails(model: Retimer, tail: list[int], o: Sequence[int], lo: int, hi: int) -> None:
    """Refresh ``tail`` (see :func:`rank_tails`) at positions lo..hi of rank order ``o`` after a move
    inside that range (the operations outside it keep theirs)."""
    dur = model.dur
    acc = tail[o[hi + 1]] + dur[o[hi + 1]] if hi + 1 < len(o) else 0
    for j in range(hi, lo - 1, -1):
        x = o[j]
        tail[x] = acc
        acc += dur[x]


def memory_ok(model: Retimer, o: Sequence[int], lo: int, hi: int, limit: float) -> bool:
    """Whether the memory of rank order ``o`` stays within ``limit`` at positions lo..hi (the only ones
    a move inside that range changes)."""
    kind, delta = model.kind, model.delta
    cur = 0.0
    for j in range(hi + 1):
        cur += delta[kind[o[j]]]
        if j >= lo and cur > limit + 1e-9:
            return False
    return True


def local_search(model: Retimer, ids: list[list[int]], limit: Sequence[float], budget: float, depth: int = 4,
                 deadline: float | None = None, max_evals: int | None = None,
                 long_moves: int = 0, gap_fill: bool = False) -> tuple[list[list[int]], float, int]:
    """First-improvement local search on whole-action orders (our addition to Alg.1; §6.2's selection by
    simulation applied to single moves).  Objective: (makespan, Σ rank finish times), lexicographic —
    the second term lets the search walk across plateaus of equal makespan without cycling.  Moves:
    :func:`critical_moves`; a move is kept only if every rank stays within its memory limit and the
    plan still runs to completion.  Each candidate is timed by :meth:`Retimer.rerun` (restart from the
    first moved operation, abort once the makespan is exceeded — or once an operation's end plus the
    rest of its rank's work exceeds it, :func:`rank_tails`).  ``budget`` in operations simulated
    (``Retimer.work``; a move is only tried while a full replay still fits); deterministic unless
    ``deadline`` (a ``time.perf_counter()`` value) cuts it short.  ``max_evals`` additionally stops it
    after that many timings (the base plan's counts as one): the budget of the compiled engine
    (``_search.c``'s ``descent``, which returns the same plan for the same ``max_evals``).
    ``long_moves``, ``gap_fill``: see :func:`critical_moves`.
    Returns (ids, makespan in ns, evaluations)."""
    w0 = model.work
    max_evals = math.inf if max_evals is None else max_evals
    base = model.run(ids, detail=True)
    mk, sf = base.makespan, base.finish_sum
    evals = 1
    n = model.n
    tail = rank_tails(model, ids)
    while model.work - w0 + n <= budget and evals < max_evals:
        improved = False
        for r, p, q in critical_moves(model, ids, base.start, base.avail, depth, long_moves, gap_fill):
            if (model.work - w0 + n > budget or evals >= max_evals
                    or (deadline is not None and time.perf_counter() > deadline)):
                return ids, mk, evals
            o = ids[r]
            lo, hi = (p, q) if p < q else (q, p)
            move_op(o, p, q)
            if not memory_ok(model, o, lo, hi, limit[r]):
                move_op(o, q, p)
                continue
            update_tails(model, tail, o, lo, hi)
            m2, s2 = model.rerun(ids, base, r, lo, hi, bound=mk, tail=tail)
            evals += 1
            if m2 < mk or (m2 <= mk and s2 < sf):
                base = model.rerun(ids, base, r, lo, hi, detail=True)
                mk, sf = base.makespan, base.finish_sum
                improved = True
                break
            move_op(o, q, p)
            update_tails(model, tail, o, lo, hi)
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


_NO_BOUND = 1 << 62
"""thresholds at or above this many ns are no bound (``_search.c``: the same constant)."""


def threshold(current: int, temp: float, u: float) -> int | float:
    """The annealing's acceptance bound in ns: ``current + ⌊temp·(−ln u)⌋`` (inf for u = 0 or beyond
    :data:`_NO_BOUND`), the same double operations as ``_search.c``."""
    if not u > 0.0:
        return math.inf
    x = temp * -math.log(u)
    if not x < _NO_BOUND:
        return math.inf
    return current + math.floor(x)


def anneal(model: Retimer, ids: list[list[int]], limit: Sequence[float], max_evals: int, seed: int, t0: float,
           max_shift: int = 6) -> tuple[list[list[int]], float, int]:
    """Simulated annealing on whole-action orders (our addition; the reference of ``_search.c``'s
    ``anneal``, which returns the same plan — the planner runs the compiled one).

    A move shifts one random operation of a random rank by 1..``max_shift`` positions (never past an
    operation of its own stage and kind, never over the rank's memory limit).  Metropolis acceptance
    on the makespan with a linearly falling temperature ``t0·(1 − evals/max_evals)`` (ns): the threshold
    ``current + ⌊−T·ln u⌋`` (integer ns: a makespan is above ``current − T·ln u`` exactly when it is
    above that) is drawn *before* the move is timed, so the timing stops as soon as the
    threshold is exceeded (and, with :func:`rank_tails`, as soon as an operation's end plus its
    rank's remaining work exceeds it).  Where the critical-path descent stops at a local optimum,
    accepting slightly worse plans crosses to other basins (docs/crosspipe.md: benchmark history).  Returns the best plan seen: (ids, makespan, evaluations)."""
    N, R = model.N, model.R
    mk, _ = model.run(ids)
    best_mk, best = mk, [list(o) for o in ids]
    tail = rank_tails(model, ids)
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
        move_op(o, p, q)
        if not memory_ok(model, o, lo, hi, limit[r]):
            move_op(o, q, p)
            continue
        update_tails(model, tail, o, lo, hi)
        u = (_splitmix64(state) >> 11) * (1.0 / 9007199254740992.0)
        temp = t0 * (1.0 - evals / max_evals)
        thr = threshold(mk, temp, u)
        evals += 1
        m2, _ = model.run(ids, bound=thr, tail=tail)
        if m2 < math.inf:
            mk = m2
            if m2 < best_mk:
                best_mk, best = m2, [list(x) for x in ids]
        else:
            move_op(o, q, p)
            update_tails(model, tail, o, lo, hi)
    return best, best_mk, evals
