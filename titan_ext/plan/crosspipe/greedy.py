"""CrossPipe greedy schedule generation (CrossPipe §4.2, Alg.1) — CrossUD, CrossUDSub, CrossWave.

The generator is a list scheduler driven by its own event-driven timing model (CrossPipe §3.5 and
§4.2.3), the same model as ``titan_ext.plan.simulate`` in delegated mode:

* a rank executes one operation at a time;
* the dependencies are ``plan.deps.table``'s (an operation's end makes available the operations its
  class feeds);
* a cross-rank dependency becomes available ``α + size·β`` after the producing operation ends, and a
  link direction carries one message at a time (``timing.LinkQueues``, first in, first out; latency α
  is pipelined, i.e. it does not occupy the link). §4.2.3's range-based occupancy — the earliest free
  window of length ``size·β`` at or after the message is ready — is the same here: every message on
  a channel is sent by one rank, at the ends of its operations, so ready times per channel never
  decrease and no window can fit before one booked earlier;
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

Output: whole actions.  torch's runtime cannot execute part of an action, so the sub-block timeline is
turned into whole actions ordered by the completion time of their last sub-block (a W interrupted by an
I is placed after that I); the portfolio then times that whole-action plan in the same model
(``simulate``'s, through ``retime.Retimer``).

Input: a :class:`~titan_ext.plan.placed.PlacedProfile` (the profile, its placement, the per-rank memory
limit and rule).  Times are integer nanoseconds (``timing.to_ns`` of the profile's ms), so ties are exact;
a W of ``w`` ns in ``n_sub`` sub-blocks takes ``w // n_sub`` ns per sub-block, the first ``w % n_sub``
sub-blocks one ns more (they add up to ``w``).

Memory (§4.2, inputs M_F, M_D, M_W, M_L): net memory change per operation in *activation units*, from
the profile's memory rule (``PlacedProfile.memory_deltas``: F = +1, I = −1, W = 0 for ``release="I"``,
i.e. the limit is on in-flight activations per rank, the quantity ``simulate`` reports as
``peak_inflight``; W = −1 instead of I for ``release="W"``).  An F is only scheduled if the rank stays
within its limit; on a rank holding several stages (CrossWave), an F of an earlier stage also keeps
memory free for the later stages on that rank (``reserve``), so the V turn can always proceed (no
memory deadlock).

The compiled ``_greedy.c`` (``_compiled.greedy_ids``) is bit-identical to :func:`greedy_schedule`.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from ..deps import ROOT, table
from ..placed import PlacedProfile
from ..profile import LinkProfile
from ..timing import LinkQueues
from .variants import KINDS, Op


class SubBlock(NamedTuple):
    """One scheduling step of Alg.1."""

    rank: int
    op: Op
    index: int
    """sub-block index within the op (0 for F and I)."""
    start_ns: int
    end_ns: int


@dataclass
class GreedyResult:
    """Result of one greedy run (or of a replay): per-rank whole-action orders and their timing."""

    orders: dict[int, list[Op]]
    """rank → whole actions (stage, 'F'|'I'|'W', microbatch) in execution order."""
    start_ns: dict[Op, int]
    end_ns: dict[Op, int]
    makespan_ns: int
    """from the first F on stage 0 (at 0) to the end of the last action anywhere (CrossPipe App.A)."""
    subblocks: list[SubBlock] = field(default_factory=list)
    """greedy only: every sub-block as scheduled by Alg.1."""
    n_sub: int = 1
    steady: str = "interleave"
    reserve: str | int = "one"
    lookahead: bool = False
    waits: int = 0
    """lookahead only: how often the rank idled for an arriving backward (0: same plan as without)."""


def trigger_channels(placed: PlacedProfile) -> list:
    """Per op class c (``deps.table``: 3·stage + kind), ``(boundary, channel)`` of the message that brings
    c's trigger to c's rank (:meth:`PlacedProfile.channel`), None when it comes from the same rank (or c
    needs nothing)."""
    deps = table(placed.num_stages)
    return [None if p < 0 else placed.channel(p // 3, c // 3) for c, p in enumerate(deps.trigger)]


def w_subblock_ns(w_ns: int, n_sub: int, index: int) -> int:
    """Duration of sub-block ``index`` of a W of ``w_ns`` ns cut into ``n_sub`` (they add up to ``w_ns``)."""
    q, rem = divmod(w_ns, n_sub)
    return q + 1 if index < rem else q


def send_links(placed: PlacedProfile) -> LinkQueues:
    """The profile's links as ``timing.LinkQueues`` (the one link model), one queue per rank direction."""
    links = placed.profile.links or (LinkProfile(),) * (placed.num_stages - 1)
    return LinkQueues(links)


def check_greedy_args(n_sub, steady: str, reserve, tie: str) -> str | int:
    """Validate Alg.1's options (one-line ValueErrors); returns ``reserve`` with "one" as 1."""
    if tie not in ("microbatch", "critical_path"):
        raise ValueError(f"tie must be 'microbatch' or 'critical_path', got {tie!r}")
    if not isinstance(n_sub, int) or n_sub < 1:
        raise ValueError(f"n_sub must be a positive int, got {n_sub!r}")
    if steady not in ("interleave", "backward_first"):
        raise ValueError(f"steady must be 'interleave' or 'backward_first', got {steady!r}")
    if reserve == "one":
        reserve = 1
    if reserve != "pending" and not (isinstance(reserve, int) and reserve >= 1):
        raise ValueError(f"reserve must be 'one', 'pending' or an int >= 1, got {reserve!r}")
    return reserve


class _Alg1:
    """The state of one Alg.1 run.  Queue index ``q = 3·stage + kind`` (kind 0 F, 1 I, 2 W); each
    queue holds ``[microbatch, available at (ns)]`` entries in microbatch order, its head at ``heads[q]``."""

    def __init__(self, placed: PlacedProfile, n_sub: int, steady: str, reserve: str | int, tie: str,
                 lookahead: bool) -> None:
        R, N, S = placed.num_ranks, placed.num_microbatches, placed.num_stages
        self.placed, self.n_sub, self.lookahead = placed, n_sub, lookahead
        self.i_later_first = tie == "critical_path"
        self.backward_first = steady == "backward_first"
        self.mf, self.mi, self.mw = placed.memory_deltas
        limit = placed.memory_limit
        self.lim = [math.inf] * R if limit is None else [x + 1e-9 for x in limit]
        rank_stages = [placed.stages_of_rank(r) for r in range(R)]
        s2r = placed.stage_to_rank
        # memory an F of stage s must leave free for the later stages of its rank (V turn): F of
        # stage s is allowed while mem + need_f[s] <= limit
        k_units = 1 if reserve == "pending" else reserve
        self.need_f = [self.mf + k_units * self.mf * sum(1 for s2 in rank_stages[s2r[s]] if s2 > s) for s in range(S)]
        self.later = [tuple(s2 for s2 in rank_stages[s2r[s]] if s2 > s) for s in range(S)]
        self.pending_rule = reserve == "pending" and any(self.later)
        self.f_stage_done = [0] * S
        self.total_f = [N * len(rank_stages[r]) for r in range(R)]
        self.deps = table(S)
        self.in_hop = trigger_channels(placed)
        self.dur_k = placed.times_ns()
        self.queues: list[list[list]] = [[] for _ in range(3 * S)]
        self.heads = [0] * (3 * S)
        for q, trigger in enumerate(self.deps.trigger):
            if trigger == ROOT:
                self.queues[q] = [[m, 0] for m in range(N)]
        # per rank: queue indices, later stage first (ties in selection go to the later stage)
        self.rank_q = [[3 * s + k for s in sorted(rank_stages[r], reverse=True) for k in (0, 1, 2)] for r in range(R)]
        self.w_left: dict[tuple[int, int], int] = {}
        self.free = [0] * R
        self.mem = [0] * R
        self.f_done = [0] * R
        self.seen_backward = [False] * R
        self.last_full = [-1] * R
        self.links = send_links(placed)
        self.start: dict[Op, int] = {}
        self.end: dict[Op, int] = {}
        self.subblocks: list[SubBlock] = []
        self.remaining = 3 * N * S
        self.version = [0] * R
        self.waits = 0
        self.heap: list[tuple[int, int, int]] = []

    def f_blocked(self, r: int, s: int) -> bool:
        """memory rule for an F of stage s on rank r"""
        if self.pending_rule and self.later[s]:
            done = self.f_stage_done
            need = self.mf * (1 + sum(done[s] + 1 - done[x] for x in self.later[s]))
            return self.mem[r] + need > self.lim[r]
        return self.mem[r] + self.need_f[s] > self.lim[r]

    def message(self, c: int, ready: int) -> int:
        """When the trigger of class ``c``, ready at ``ready``, reaches c's rank (``ready`` if same rank)."""
        hop = self.in_hop[c]
        if hop is None:
            return ready
        return self.links.send(hop[0], hop[1], ready)

    def finish(self, r: int, q: int, m: int, t1: int) -> None:
        """Op (class q, microbatch m) ended at t1 on rank r: the classes q feeds (``deps``) get m; rank r and
        every other rank fed are rescheduled."""
        feeds = self.deps.feeds_of(q)
        for c in feeds:
            self.arrive(c, m, self.message(c, t1))
        self.push(r)
        pushed = {r}
        for c in feeds:
            r2 = self.placed.stage_to_rank[c // 3]
            if r2 not in pushed:
                pushed.add(r2)
                self.push(r2)

    def push(self, r: int) -> None:
        """(Re)schedule rank r at its schedulable time (stage selection, §4.2.2)."""
        self.version[r] += 1
        best = None
        for q in self.rank_q[r]:
            h = self.heads[q]
            qq = self.queues[q]
            if h < len(qq):
                a = qq[h][1]
                if (best is None or a < best) and not (q % 3 == 0 and self.f_blocked(r, q // 3)):
                    best = a
        if best is not None:
            fr = self.free[r]
            heapq.heappush(self.heap, (best if best > fr else fr, r, self.version[r]))

    def arrive(self, q: int, m: int, avail: int) -> None:
        qq = self.queues[q]
        if not qq or qq[-1][0] < m:
            qq.append([m, avail])
        else:  # keep microbatch order so the head is the lowest microbatch
            i = len(qq)
            while i > self.heads[q] and qq[i - 1][0] > m:
                i -= 1
            qq.insert(i, [m, avail])

    def available(self, r: int, t: int) -> list:
        """Per kind: the best (microbatch, queue) available on rank r at t (lowest microbatch, then the
        later stage; with ``tie="critical_path"`` the later stage first for I), or None."""
        best_k: list = [None, None, None]
        for q in self.rank_q[r]:
            h = self.heads[q]
            qq = self.queues[q]
            if h < len(qq):
                m, a = qq[h]
                if a > t:
                    continue
                k = q % 3
                if k == 0 and self.f_blocked(r, q // 3):
                    continue
                cur = best_k[k]
                if cur is None or (m < cur[0] and not (k == 1 and self.i_later_first)):
                    best_k[k] = (m, q)
        return best_k

    def select(self, r: int, best_k: list) -> int:
        """Operation selection (§4.2.2): the kind to run among the available ones."""
        if not self.seen_backward[r] and best_k[1] is not None:
            self.seen_backward[r] = True  # warm-up ends when the first backward can run here
        if self.f_done[r] == self.total_f[r]:
            order = (1, 2, 0)  # tear-down: D before W
        elif not self.seen_backward[r]:
            order = (0, 1, 2)  # warm-up: F first
        elif self.backward_first or self.last_full[r] == 0:
            order = (1, 0, 2)  # steady: interleave F and D full blocks
        else:
            order = (0, 1, 2)
        for k in order:
            if best_k[k] is not None:
                return k
        raise AssertionError("a popped rank always has an available operation")

    def wait_for_backward(self, r: int, t: int, t1: int) -> bool:
        """Lookahead: a backward already on its way that would land while this F/W runs goes first —
        idle until it arrives instead of delaying the backward chain (PipeMorph's B > F > W order)."""
        soonest = None
        for q2 in self.rank_q[r]:
            if q2 % 3 == 1 and self.heads[q2] < len(self.queues[q2]):
                a = self.queues[q2][self.heads[q2]][1]
                if soonest is None or a < soonest:
                    soonest = a
        if soonest is not None and t < soonest < t1:
            self.version[r] += 1
            heapq.heappush(self.heap, (soonest, r, self.version[r]))
            self.waits += 1
            return True
        return False

    def duration(self, k: int, s: int, m: int) -> int:
        """The next block of op (s, kind k, m): the whole F or I, or the W's next sub-block."""
        if k != 2:
            return self.dur_k[k][s]
        return w_subblock_ns(self.dur_k[2][s], self.n_sub, self.n_sub - self.w_left.get((s, m), self.n_sub))

    def run_w_subblock(self, r: int, q: int, m: int, t: int, t1: int) -> None:
        """One sub-block of a W (§4.2.1); the rest of the W stays at the head of its queue."""
        s, n_sub = q // 3, self.n_sub
        op = (s, KINDS[2], m)
        nleft = self.w_left.get((s, m), n_sub)
        self.subblocks.append(SubBlock(r, op, n_sub - nleft, t, t1))
        if nleft == n_sub:
            self.start[op] = t
        nleft -= 1
        if nleft:
            self.w_left[(s, m)] = nleft
            self.queues[q][self.heads[q]][1] = t1
            self.push(r)
        else:
            self.w_left.pop((s, m), None)
            self.heads[q] += 1
            self.end[op] = t1
            self.mem[r] += self.mw
            self.remaining -= 1
            self.finish(r, q, m, t1)

    def run_full(self, r: int, k: int, q: int, m: int, t: int, t1: int) -> None:
        """An F or I as one block; its end makes the next operations of microbatch m available."""
        s = q // 3
        op = (s, KINDS[k], m)
        self.subblocks.append(SubBlock(r, op, 0, t, t1))
        self.start[op] = t
        self.end[op] = t1
        self.heads[q] += 1
        self.remaining -= 1
        self.last_full[r] = k
        if k == 0:
            self.mem[r] += self.mf
            self.f_done[r] += 1
            self.f_stage_done[s] += 1
        else:
            self.mem[r] += self.mi
        self.finish(r, q, m, t1)

    def step(self) -> None:
        """Pop the rank with the earliest schedulable time and run one operation (or sub-block) there."""
        if not self.heap:
            raise ValueError(
                "CrossPipe greedy: no rank can proceed — the memory limit admits no schedule "
                f"(memory_limit={self.placed.memory_limit})"
            )
        t, r, ver = heapq.heappop(self.heap)
        if ver != self.version[r]:
            return
        best_k = self.available(r, t)
        k = self.select(r, best_k)
        m, q = best_k[k]
        t1 = t + self.duration(k, q // 3, m)
        if self.lookahead and k != 1 and self.wait_for_backward(r, t, t1):
            return
        self.free[r] = t1
        if k == 2:
            self.run_w_subblock(r, q, m, t, t1)
        else:
            self.run_full(r, k, q, m, t, t1)

    def result(self, steady: str, reserve: str | int) -> GreedyResult:
        """Whole actions ordered by the completion of their last sub-block (ties: start)."""
        end, start = self.end, self.start
        orders: dict[int, list[Op]] = {r: [] for r in range(self.placed.num_ranks)}
        for op in sorted(end, key=lambda o: (end[o], start[o])):
            orders[self.placed.stage_to_rank[op[0]]].append(op)
        makespan = max(end.values())  # the first F of stage 0 starts at 0
        return GreedyResult(orders, start, end, makespan, self.subblocks, self.n_sub, steady, reserve,
                            self.lookahead, self.waits)


def greedy_schedule(
    placed: PlacedProfile,
    n_sub: int = 1,
    steady: str = "interleave",
    reserve: str | int = "one",
    tie: str = "microbatch",
    lookahead: bool = False,
) -> GreedyResult:
    """One run of CrossPipe's greedy generator (§4.2, Alg.1) with ``n_sub`` sub-blocks per W on ``placed``
    (a :class:`~titan_ext.plan.placed.PlacedProfile`; times in integer ns).

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
    if not isinstance(placed, PlacedProfile):
        from ...args import ArgumentTypeError
        raise ArgumentTypeError(f"placed must be a PlacedProfile, got {type(placed).__name__}")
    reserve = check_greedy_args(n_sub, steady, reserve, tie)
    run = _Alg1(placed, n_sub, steady, reserve, tie, lookahead)
    for r in range(placed.num_ranks):
        run.push(r)
    while run.remaining:
        run.step()
    return run.result(steady, reserve)
