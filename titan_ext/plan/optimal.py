"""Optimal pipeline schedules: CrossPipe's constraint model (§4.1) solved with OR-Tools CP-SAT.

Input: the description every CrossPipe planner reads, a :class:`~titan_ext.plan.placed.PlacedProfile`
(stage-level profile, stage → rank placement, per-rank memory limit, the profile's memory rule).  Times
are the profile's in integer ns (``timing.to_ns``); the solver's grid is the coarsest power of ten of
ns (at most 1 ms) that divides every one of them (:func:`time_unit_ns_for`), so no time is rounded and
a plan is timed on the grid by ``simulate``'s model (:class:`~titan_ext.plan.crosspipe.retime.Retimer`).

Model (CrossPipe §4.1, in integer time units of ``time_unit_ns``):

* **operations** – every compute operation (stage, F/I/W, microbatch) is an interval on its rank;
  every cross-rank message is a first-class operation: an interval of length ``size·β`` (the
  bandwidth part, d_c) on its channel (src rank → dst rank), followed by its latency ℓ_c = α;
* **data dependencies** – ``t_o ≥ t_p + d_p (+ ℓ_p if p is a message)`` for every predecessor p
  (F(s−1)→msg→F(s), F(last)→I(last), I(s+1)→msg→I(s), I(s)→W(s)); same-rank dependencies (the V turn of
  CrossWave) need no message;
* **resource non-overlap** – one operation at a time per rank and per channel; the paper writes this
  with order variables x_{o,o'} and a big-M; CP-SAT expresses the same disjunction natively with
  ``AddNoOverlap`` (its order literals are the x_{o,o'});
* **memory** – per rank, the activations held (F started … its I ended, plus F … W for the part of the
  activation W keeps, ``memory_deltas``) never exceed ``memory_limit`` — the paper's Σ m_p·u_{p,q} ≤ M,
  written as a cumulative constraint;
* **microbatch order within stage and type** (the paper's search-space reduction) – optional, on by
  default;
* **objective** – the makespan of CrossPipe App.A: from the first F on stage 0 (fixed at t = 0, which
  loses nothing: every operation depends on it) to the last end anywhere.

Strengthened model (``redundant=True``, default; needs the microbatch order).  None of these changes
the optimum; each is either implied by the constraints above or justified below, and the tests compare
the optimum with the plain model (``redundant=False``), hand-derived optima and brute force:

* *Why microbatch order loses nothing* (exchange argument).  Microbatches are identical jobs: each is
  the chain F(0) → … → F(S−1) → I(S−1) → … → I(0) with W(s) after I(s), every link of the chain at a
  fixed chain position.  Take any feasible schedule and keep, at every chain position, the multiset
  of start times ("slots") and, on every channel, the slots of that position's messages; reassign
  the slots of each position to microbatches in order of readiness (k-th earliest ready → k-th
  slot).  A bijection ready ≤ slot existed, so the sorted matching is feasible too; by induction the
  ready times at the next position are again the same multiset, now in microbatch order.  Resource
  occupation (rank and channel slots) is unchanged, memory only counts F started / I ended per stage
  (not which microbatch), the makespan is unchanged — and every (stage, type) and every boundary's
  messages now run in microbatch order.  Hence also **messages of one boundary in microbatch order**
  (c(b, m+1) ≥ c(b, m) + size·β).
* **memory as precedences**: on a rank holding one stage with deltas (M_F, −M_F, 0) and limit L·M_F,
  with F and I in microbatch order the I's ended at the start of F(s, j) are a prefix, so the limit
  holds iff F(s, m + L) starts after I(s, m) ends — an exact replacement of the cumulative.  Other
  ranks (CrossWave, W holding memory) keep the cumulative, with each interval's size bounded below by
  one microbatch's dependency chain (F(s) start → I(s) end or W(s) end).
* **domains from heads and tails**: longest paths through all these precedences give every start
  a window [head, H − tail] (H = makespan of the hint); max(head + tail) and, per rank and per
  channel, Jackson's preemptive one-machine bound with those heads and tails give the makespan's lower
  bound (the root bound; on these benchmarks it often is the optimum).
* **hint**: the best CrossPipe greedy plan (CrossUD, CrossUDSub portfolios), its last W's moved to
  the end where that shortens it, replayed on the integer grid and given complete (operations,
  messages FIFO per channel, makespan), then *tail-polished*: CP-SAT re-optimises the operations
  starting after 80 %, 60 %, 40 %, 20 % of its makespan with the rest fixed (small models; the greedy
  loses its time in the cool-down, where the last microbatch's backward chain is critical).

Search (``deterministic=True``, default): with several workers CP-SAT runs ``interleave_search``
and stops at ``max_deterministic_time`` (default 0.6 × ``time_limit_s`` work units), so a run does
the same search whatever the machine load (the wall-clock ``time_limit_s`` stays as a safety net);
``random_seed`` is fixed (0).  ``deterministic=False`` uses CP-SAT's parallel portfolio instead: often
faster but its path, and so an unproven result, varies from run to run.

OR-Tools is an optional extra (``pip install titan-ext[solver]``); it is imported inside
:func:`solve_optimal` only, so ``import titan_ext.plan`` stays light.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Mapping, Sequence

from .crosspipe.portfolio import plan_crosspipe_placed
from .crosspipe.retime import Retimer
from .crosspipe.variants import F, I, W, Op, placed_from_profile, to_actions
from ..args import ArgumentTypeError, bool_arg, int_arg, real_arg
from .profile import profile_arg
from .deps import table
from .interrupt import solve
from .placed import PlacedProfile
from .timing import NS_PER_MS, to_ms, to_ns


def _check_solver_args(time_limit_s, workers, flags: dict) -> None:
    real_arg(time_limit_s, "time_limit_s", positive=True)
    int_arg(workers, "workers", 1)
    for name, value in flags.items():
        bool_arg(value, name)

__all__ = ["OptimalResult", "solve_optimal", "solve_optimal_problem", "time_unit_ns_for"]


@dataclass
class OptimalResult:
    """What CP-SAT found for one problem."""

    status: str
    """"OPTIMAL", "FEASIBLE" (time limit hit with a solution) or "UNKNOWN"/"INFEASIBLE"."""
    proven: bool
    makespan_ms: float | None
    """makespan of the best solution (solver's own timing), None if none was found."""
    bound_ms: float
    """CP-SAT's proven lower bound on the makespan."""
    orders: dict[int, list[Op]] | None
    actions: dict | None
    """rank → list[_Action] of the best solution (operations sorted by their solver start)."""
    start_ms: dict[Op, float] | None
    solve_s: float
    time_unit_ms: float
    num_ops: int
    num_messages: int
    hint_ms: float | None = None
    """makespan of the greedy hint the solver started from (None: no hint)."""
    params: dict = field(default_factory=dict)
    makespan_ns: int | None = None
    """``makespan_ms`` in integer ns (the unit the solver and ``simulate`` time in)."""

    @property
    def gap(self) -> float | None:
        """Relative gap (best − bound) / best of this solve."""
        if self.makespan_ms is None or self.makespan_ms <= 0:
            return None
        return (self.makespan_ms - self.bound_ms) / self.makespan_ms


def time_unit_ns_for(values_ns: Sequence[int]) -> int:
    """The coarsest time unit (ns, a power of ten, at most 1 ms) that divides every value: the solver's
    integer grid (1 ns at the finest, so no time is ever rounded)."""
    unit = NS_PER_MS
    while unit > 1 and any(v % unit for v in values_ns):
        unit //= 10
    return unit


def _longest_paths(nodes: list, dur: dict, arcs: list[tuple[object, object, int]]) -> tuple[dict, dict]:
    """Heads and tails of a precedence DAG: ``head[v]`` = longest path from a source to the start of
    v, ``tail[v]`` = longest path from the start of v to the end of the schedule (≥ dur[v]); an arc
    (u, v, d) means start[v] ≥ start[u] + d."""
    out: dict = {v: [] for v in nodes}
    indeg = {v: 0 for v in nodes}
    for u, v, d in arcs:
        out[u].append((v, d))
        indeg[v] += 1
    order = [v for v in nodes if indeg[v] == 0]
    i = 0
    while i < len(order):
        for v, _ in out[order[i]]:
            indeg[v] -= 1
            if indeg[v] == 0:
                order.append(v)
        i += 1
    if len(order) != len(nodes):  # pragma: no cover - the arcs below always form a DAG
        raise ValueError("precedence cycle")
    head = {v: 0 for v in nodes}
    for u in order:
        for v, d in out[u]:
            if head[u] + d > head[v]:
                head[v] = head[u] + d
    tail = {}
    for u in reversed(order):
        t = dur[u]
        for v, d in out[u]:
            t = max(t, d + tail[v])
        tail[u] = t
    return head, tail


def _jackson_bound(jobs: list[tuple[int, int, int]]) -> int:
    """Preemptive one-machine bound (Jackson's preemptive schedule): jobs (release, duration, delivery
    time after completion); returns max over jobs of completion + delivery, a lower bound on the
    makespan of any non-preemptive schedule of these jobs on one machine."""
    import heapq

    jobs = sorted(jobs)
    t, i, best, ready = 0, 0, 0, []  # ready: (-delivery, remaining)
    n = len(jobs)
    while i < n or ready:
        if not ready and t < jobs[i][0]:
            t = jobs[i][0]
        while i < n and jobs[i][0] <= t:
            heapq.heappush(ready, (-jobs[i][2], jobs[i][1]))
            i += 1
        neg_q, rem = heapq.heappop(ready)
        nxt = jobs[i][0] if i < n else None
        run = rem if nxt is None else min(rem, nxt - t)
        t += run
        if run < rem:
            heapq.heappush(ready, (neg_q, rem - run))
        else:
            best = max(best, t - neg_q)
    return best


def _defer_weight_grads(problem: PlacedProfile, orders: dict, unit_ns: int = 1) -> tuple[int, dict]:
    """Hint polish: W has no successor (only the makespan), so moving the last k W of a rank to the
    end of its program keeps the plan valid (memory only falls at I) and can shorten the cool-down,
    where the backward chain of the last microbatch is critical.  Coordinate descent over ranks and
    k, judged by ``simulate``'s model on the solver's grid (:func:`_timer`); returns (makespan in
    units, orders), never worse than the input."""
    N = problem.num_microbatches
    time_of = _timer(problem, unit_ns)
    best = time_of(orders)
    orders = {r: list(o) for r, o in orders.items()}
    improved = True
    while improved:
        improved = False
        for r in reversed(range(problem.num_ranks)):
            base = orders[r]
            for k in range(1, N + 1):
                late = {op for op in base if op[1] == W and op[2] >= N - k}
                trial = dict(orders)
                trial[r] = [op for op in base if op not in late] + sorted(late, key=lambda o: (o[2], o[0]))
                ms = time_of(trial)
                if ms < best:
                    best, orders, improved = ms, trial, True
                    break
    return best, orders


def _timer(problem: PlacedProfile, unit_ns: int = 1):
    """orders → makespan (in units of ``unit_ns``) under ``simulate``'s model, built once
    (:class:`Retimer`; ``_search.c``'s bit-identical copy where it is built)."""
    from .crosspipe import _compiled

    model = Retimer(problem, unit_ns)
    eng = _compiled.engine()
    if eng is None or not _compiled.exact_in_c(problem):
        return lambda orders: model.run(model.ids(orders))[0]
    cap = eng.model(model.spec())
    return lambda orders: eng.run(cap, model.ids(orders), math.inf)[0]


def _hint_candidates(problem: PlacedProfile, hint_orders: Mapping[int, Sequence[Op]] | None):
    """The plans the hint is chosen from: ``hint_orders`` alone when given, else the CrossPipe greedy
    portfolios (CrossWave on a V-shape problem, CrossUD and CrossUDSub otherwise)."""
    if hint_orders is not None:
        problem.check_orders(hint_orders)  # complete, split backwards, on their stages' ranks
        yield {r: list(o) for r, o in hint_orders.items()}
        return
    wave_shape = any(problem.stage_to_rank.count(r) > 1 for r in range(problem.num_ranks))
    for variant in ("wave",) if wave_shape else ("ud", "udsub"):
        try:
            yield plan_crosspipe_placed(problem, variant, convert=False).orders
        except ValueError:
            continue


def solve_optimal_problem(
    problem: PlacedProfile,
    *,
    time_limit_s: float = 60.0,
    workers: int = 1,
    microbatch_order: bool = True,
    hint: bool = True,
    time_unit_ns: int | None = None,
    random_seed: int = 0,
    redundant: bool = True,
    deterministic_time: float | None = None,
    disjunctive_ranks: Sequence[int] | None = None,
    lower_bound_ms: float | None = None,
    upper_bound_ms: float | None = None,
    deterministic: bool = True,
    tail_polish: Sequence[float] | None = None,
    hint_orders: Mapping[int, Sequence[Op]] | None = None,
    polish_step_dtime: float | None = None,
    log: bool = False,
) -> OptimalResult:
    """Solve CrossPipe §4.1 for ``problem`` with CP-SAT (see the module docstring).

    ``hint``: start from the best CrossPipe greedy plan (a complete feasible solution on the integer
    grid: faster first solution, tighter horizon, same optimum).
    ``hint_orders`` (rank → ops, a complete plan of ``problem``): the hint is this plan instead of the
    greedy's (its last W's deferred where that shortens it, as the greedy's) — the warm start of
    :func:`titan_ext.plan.polish.polish_orders`.
    ``time_unit_ns``: integer time grid in ns; default: the coarsest power of ten that divides every
    time (:func:`time_unit_ns_for`; times are rounded to a coarser one given here).
    ``redundant`` (needs ``microbatch_order``): the strengthened model of the module docstring —
    memory as precedences, messages in microbatch order, head/tail domains, per-rank one-machine
    bounds.  Same optimum as ``redundant=False`` (the plain §4.1 model); tests check both.
    ``deterministic`` / ``deterministic_time``: reproducible search (module docstring);
    ``deterministic_time`` is CP-SAT's ``max_deterministic_time`` (default 0.6 × ``time_limit_s``
    when ``deterministic``), the wall-clock ``time_limit_s`` applies as well, end to end: model
    building, the hint and its polish count against it (the final solve gets what is left).
    ``tail_polish``: fractions of the hint's makespan after which the hint is re-optimised (default
    (0.8, 0.6, 0.4, 0.2); ``()``: off); ``polish_step_dtime``: deterministic work units per step
    (default 0.04 × ``time_limit_s``, within [0.05, 2]).  ``deterministic_time=0``: the hint and its
    polish only, no final search.  When the final search ends above the polished hint, the hint is
    returned (status "FEASIBLE").
    ``disjunctive_ranks`` (relaxation): only these ranks get the one-at-a-time constraint; the
    optimum is then a lower bound of the full problem's.  ``lower_bound_ms`` / ``upper_bound_ms``:
    known bounds on the optimum (a wrong lower bound makes the answer wrong; an upper bound below the
    optimum makes the model infeasible) — for decompositions and feasibility probes.
    """
    _check_solver_args(time_limit_s, workers, {"microbatch_order": microbatch_order, "hint": hint,
                                                "redundant": redundant, "deterministic": deterministic, "log": log})
    if not isinstance(problem, PlacedProfile):
        raise ArgumentTypeError(f"problem must be a PlacedProfile, got {type(problem).__name__}")
    int_arg(time_unit_ns, "time_unit_ns", 1, optional=True)
    real_arg(deterministic_time, "deterministic_time", minimum=0, optional=True)
    int_arg(random_seed, "random_seed")
    try:
        from ortools.sat.python import cp_model
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("the optimal solver needs OR-Tools: pip install 'titan-ext[solver]'") from e

    t_start = time.perf_counter()

    def time_left() -> float:  # of the wall-clock time_limit_s, model building and polishing included
        return max(0.01, float(time_limit_s) - (time.perf_counter() - t_start))

    R, N, S = problem.num_ranks, problem.num_microbatches, problem.num_stages
    s2r = problem.stage_to_rank
    redundant = redundant and microbatch_order
    f_ns, b_ns, w_ns = problem.times_ns()
    link_ns = [problem.link_ns(b) for b in range(S - 1)]
    unit = time_unit_ns if time_unit_ns is not None else time_unit_ns_for(
        list(f_ns) + list(b_ns) + list(w_ns) + [x for pair in link_ns for x in pair])
    q = lambda ns: int(round(ns / unit))  # noqa: E731
    dur = {F: [q(x) for x in f_ns], I: [q(x) for x in b_ns], W: [q(x) for x in w_ns]}
    lat = [q(a) for a, _ in link_ns]
    tx = [q(t) for _, t in link_ns]
    grid = Retimer(problem, unit)  # simulate's model on the solver's grid

    # ---- greedy hint, replayed on the integer grid (an exact feasible solution of the model)
    hint_int = None
    hint_ms = None
    if hint:
        best = None
        for plan_orders in _hint_candidates(problem, hint_orders):
            if problem.memory_deltas[2] == 0:
                _, orders = _defer_weight_grads(problem, plan_orders, unit)
            else:  # a W that frees memory is not a pure filler: keep the greedy order
                orders = plan_orders
            rq = _grid_timing(grid, orders)
            if best is None or rq[0] < best[0][0]:
                best = (rq, orders)
        if best is not None:
            hint_int = best[0]  # (makespan, op → start), in units
            hint_ms = to_ms(Retimer(problem).run(grid.ids(best[1]))[0])
    total = sum(dur[k][s] for s in range(S) for k in (F, I, W)) * N
    comm = sum(lat) + sum(tx)
    horizon = total + 2 * N * (comm + 1) + 1
    if hint_int is not None:
        horizon = min(horizon, hint_int[0])

    # ---- memory as precedences (exact with microbatch order, see the module docstring)
    mf, mi, mw = problem.memory_deltas
    mem_lag: dict[int, int] = {}  # stage → L: F(s, m+L) starts after I(s, m) ends
    if redundant and problem.memory_limit is not None and abs(mw) < 1e-12:
        for r in range(R):
            stages = problem.stages_of_rank(r)
            if len(stages) == 1:
                mem_lag[stages[0]] = int(math.floor(problem.memory_limit[r] / mf + 1e-9))

    # ---- precedence graph: ops (s, k, m) and messages ("c", s_src, k_src, m); arcs (u, v, d): t_v ≥ t_u + d
    ops = [(s, k, mb) for s in range(S) for k in (F, I, W) for mb in range(N)]
    node_dur = {op: dur[op[1]][op[0]] for op in ops}
    arcs: list[tuple] = []
    messages: list[tuple] = []  # (node, src op, dst op, boundary, channel)

    num_messages = 0

    def link(src: Op, dst: Op) -> None:
        nonlocal num_messages
        hop = problem.channel(src[0], dst[0])
        d = node_dur[src]
        if hop is None:
            arcs.append((src, dst, d))
            return
        b, channel = hop  # times: the grid's tx/lat above
        num_messages += 1
        if tx[b] > 0:
            c = ("c",) + src
            node_dur[c] = tx[b]
            messages.append((c, src, dst, b, channel))
            arcs.append((src, c, d))
            arcs.append((c, dst, tx[b] + lat[b]))
        else:
            arcs.append((src, dst, d + lat[b]))

    # data dependencies: deps.table's (trigger → op; the producers it implies add nothing), by the lower
    # stage of the pair, then the consumer's kind (the order the model's variables always had)
    kinds = (F, I, W)
    deps_edges = sorted(table(S).edges(), key=lambda e: (min(e[0] // 3, e[1] // 3), e[1] % 3))
    for mb in range(N):
        for p, c in deps_edges:
            link((p // 3, kinds[p % 3], mb), (c // 3, kinds[c % 3], mb))
    chain_arcs = list(arcs)  # one microbatch's data dependencies (for the memory intervals' sizes)
    if microbatch_order:
        for s in range(S):
            for k in (F, I, W):
                for mb in range(N - 1):
                    arcs.append(((s, k, mb), (s, k, mb + 1), dur[k][s]))
    if redundant:
        for c, src, _, b, _ in messages:
            if src[2] < N - 1:
                arcs.append((c, ("c", src[0], src[1], src[2] + 1), tx[b]))
        for s, lag in mem_lag.items():
            for mb in range(N - lag):
                arcs.append(((s, I, mb), (s, F, mb + lag), dur[I][s]))
    nodes = ops + [c for c, *_ in messages]
    head, tail = _longest_paths(nodes, node_dur, arcs if redundant else chain_arcs)
    lb = max(head[v] + tail[v] for v in nodes)
    if redundant:
        for r in range(R):
            jobs = [(head[op], node_dur[op], tail[op] - node_dur[op]) for op in ops if s2r[op[0]] == r]
            lb = max(lb, _jackson_bound(jobs))
        for ch in {m_[4] for m_ in messages}:
            jobs = [(head[c], node_dur[c], tail[c] - node_dur[c]) for c, *_, chan in messages if chan == ch]
            lb = max(lb, _jackson_bound(jobs))
    if lower_bound_ms is not None:
        lb = max(lb, -(-to_ns(lower_bound_ms) // unit))
    horizon = max(horizon, lb)
    if upper_bound_ms is not None:
        horizon = min(horizon, to_ns(upper_bound_ms) // unit)

    m = cp_model.CpModel()
    start: dict = {}
    end: dict = {}
    rank_intervals: list[list] = [[] for _ in range(R)]
    channel_intervals: dict[tuple[int, int], list] = {}
    for v in nodes:
        lo, hi = (head[v], horizon - tail[v]) if redundant else (0, horizon)
        if v[0] == "c":
            hi = horizon if not redundant else hi
        st = m.NewIntVar(lo, max(lo, hi), f"t_{v}")
        start[v] = st
        end[v] = st + node_dur[v]
    for op in ops:
        rank_intervals[s2r[op[0]]].append(m.NewFixedSizeIntervalVar(start[op], node_dur[op], f"iv_{op}"))
    for c, _, _, b, channel in messages:
        channel_intervals.setdefault(channel, []).append(m.NewFixedSizeIntervalVar(start[c], tx[b], f"civ_{c}"))
    m.Add(start[(0, F, 0)] == 0)
    for u, v, d in arcs:
        m.Add(start[v] >= start[u] + d)
    for r in range(R) if disjunctive_ranks is None else disjunctive_ranks:
        m.AddNoOverlap(rank_intervals[r])
    for ivs in channel_intervals.values():
        m.AddNoOverlap(ivs)

    # ---- memory (per rank, where not already exact precedences): activation of (s, mb) held from
    # the start of F to the end of I (|M_D| units) and, for the part W keeps, to the end of W (|M_W|)
    if problem.memory_limit is not None:
        # minimal holding times from one microbatch's dependency chain (valid interval size bounds)
        h1, _ = _longest_paths(nodes, node_dur, chain_arcs)
        fr = [Fraction(x).limit_denominator(1000) for x in (mf, -mi, -mw) + tuple(problem.memory_limit)]
        den = math.lcm(*(x.denominator for x in fr))
        d_i, d_w = int(fr[1] * den), int(fr[2] * den)
        for r in range(R):
            cap = int(math.floor(fr[3 + r] * den + 1e-9))
            ivs, demands = [], []
            for s in range(S):
                if s2r[s] != r or s in mem_lag:
                    continue
                hold_i = h1[(s, I, 0)] + dur[I][s] - h1[(s, F, 0)]
                hold_w = h1[(s, W, 0)] + dur[W][s] - h1[(s, F, 0)]
                for mb in range(N):
                    if d_i:
                        size = m.NewIntVar(hold_i if redundant else 0, horizon, "")
                        ivs.append(m.NewIntervalVar(start[(s, F, mb)], size, end[(s, I, mb)], f"act_{s}_{mb}"))
                        demands.append(d_i)
                    if d_w:
                        size = m.NewIntVar(hold_w if redundant else 0, horizon, "")
                        ivs.append(m.NewIntervalVar(start[(s, F, mb)], size, end[(s, W, mb)], f"actw_{s}_{mb}"))
                        demands.append(d_w)
            if ivs:
                m.AddCumulative(ivs, demands, cap)

    # ---- objective: makespan from the first F on stage 0 (= 0) to the last end anywhere
    makespan = m.NewIntVar(lb if redundant else 0, horizon, "makespan")
    for s in range(S):
        for mb in range(N) if not microbatch_order else (N - 1,):
            m.Add(makespan >= end[(s, W, mb)])
    # per-rank bound: the rank cannot start before its first F can arrive, then has all its work to do
    for r in range(R):
        stages = [s for s in range(S) if s2r[s] == r]
        work = N * sum(dur[k][s] for s in stages for k in (F, I, W))
        m.Add(makespan >= min(head[(s, F, 0)] for s in stages) + work)
    m.Minimize(makespan)

    if hint_int is not None:
        # a complete hint (ops, messages FIFO per channel as replay sends them, makespan): CP-SAT
        # checks it at once instead of completing it by search
        hs = dict(hint_int[1])
        free_at: dict = {}
        for c, src, _, b, ch in sorted(messages, key=lambda x: (hs[x[1]] + node_dur[x[1]], x[1][2], x[1][0])):
            hs[c] = max(hs[src] + node_dur[src], free_at.get(ch, 0))
            free_at[ch] = hs[c] + tx[b]
        for v in nodes:
            m.AddHint(start[v], hs[v])
        m.AddHint(makespan, hint_int[0])

    tail_info = []
    if tail_polish is None:
        tail_polish = (0.8, 0.6, 0.4, 0.2)
    cur, cur_mk = None, None
    if hint_int is not None and tail_polish and lb < hint_int[0]:
        step_dtime = polish_step_dtime or max(0.05, min(2.0, 0.04 * time_limit_s))  # deterministic units
        cur, cur_mk = _neighbourhood_polish(
            m, nodes, start, makespan, dict(hs), hint_int[0], lb, tail_polish,
            lambda ps: _set_params(ps, min(float(time_limit_s) / 4 if deterministic else
                                           max(0.05, min(3.0, 0.05 * time_limit_s)), time_left() / 4),
                                   step_dtime, workers, deterministic, random_seed), tail_info, unit)
        m.ClearHints()
        for v in nodes:
            m.AddHint(start[v], cur[v])
        m.AddHint(makespan, cur_mk)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_left()  # time_limit_s holds end to end
    if deterministic and deterministic_time is None:
        deterministic_time = 0.6 * float(time_limit_s)
    if deterministic_time is not None:
        solver.parameters.max_deterministic_time = float(deterministic_time)
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = int(random_seed)
    solver.parameters.log_search_progress = bool(log)
    if deterministic and workers > 1:
        solver.parameters.interleave_search = True
    ran = deterministic_time is None or deterministic_time > 0  # 0: the polish alone, no final search
    status = solve(solver, m) if ran else cp_model.UNKNOWN  # signal handlers kept (interrupt.py)
    solve_s = time.perf_counter() - t_start
    name = solver.StatusName(status)
    num_ops = 3 * N * S
    params = {"time_limit_s": time_limit_s, "workers": workers, "microbatch_order": microbatch_order, "hint": hint,
              "redundant": redundant, "deterministic_time": deterministic_time, "root_bound_ms": to_ms(lb * unit),
              "tail_polish": tail_info}
    solved = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    if cur is not None and (not solved or solver.ObjectiveValue() > cur_mk):  # keep the polished hint
        starts = {op: cur[op] for op in ops}
        bound = max(lb, solver.BestObjectiveBound()) if solved else lb
        return _result(grid, problem, starts, dur, s2r, "FEASIBLE", False, cur_mk, bound, unit, solve_s,
                       num_messages, hint_ms, params)
    if not solved:
        bound = solver.BestObjectiveBound() if ran else lb
        return OptimalResult(name, False, None, to_ms(int(round(bound)) * unit), None, None, None, solve_s, to_ms(unit),
                             num_ops, num_messages, hint_ms, params)
    starts = {op: solver.Value(start[op]) for op in ops}
    return _result(grid, problem, starts, dur, s2r, name, status == cp_model.OPTIMAL, solver.ObjectiveValue(),
                   solver.BestObjectiveBound(), unit, solve_s, num_messages, hint_ms, params)


def _grid_timing(grid: Retimer, orders) -> tuple[int, dict]:
    """(makespan, op → start) of ``orders`` on the solver's grid (``simulate``'s model, in units)."""
    ids = grid.ids(orders)
    timed = grid.run(ids, detail=True)
    if timed.makespan == math.inf:
        raise ValueError("the hint plan deadlocks")
    start = timed.start
    return timed.makespan, {op: start[i] for r in range(grid.R) for op, i in zip(orders[r], ids[r])}


def _result(grid, problem, starts, dur, s2r, name, proven, objective, bound, unit, solve_s, num_messages,
            hint_ms, params) -> OptimalResult:
    """The :class:`OptimalResult` of integer start times ``starts`` (op → units)."""
    orders: dict[int, list[Op]] = {r: [] for r in range(problem.num_ranks)}
    kind_rank = {F: 0, I: 1, W: 2}
    for op in sorted(starts, key=lambda o: (starts[o], starts[o] + dur[o[1]][o[0]], kind_rank[o[1]], o[2])):
        orders[s2r[op[0]]].append(op)
    # the solver's objective may carry slack when not proven; the plan's own (replayed, semi-active)
    # makespan on the integer grid is never larger and is what the plan achieves
    best_ns = min(int(round(objective)), grid.run(grid.ids(orders))[0]) * unit
    return OptimalResult(
        status=name, proven=proven, makespan_ms=to_ms(best_ns), bound_ms=to_ms(int(round(bound)) * unit),
        orders=orders, actions=to_actions(orders), start_ms={op: to_ms(t * unit) for op, t in starts.items()},
        solve_s=solve_s, time_unit_ms=to_ms(unit), num_ops=3 * problem.num_microbatches * problem.num_stages,
        num_messages=num_messages, hint_ms=hint_ms, params=params, makespan_ns=best_ns,
    )


def _set_params(ps, max_time_s: float, dtime: float | None, workers: int, deterministic: bool, seed: int):
    """One CP-SAT solver's limits and search settings (a polish step's)."""
    ps.parameters.max_time_in_seconds = max(0.01, max_time_s)
    if deterministic and dtime is not None:
        ps.parameters.max_deterministic_time = dtime
    ps.parameters.num_workers = int(workers)
    ps.parameters.interleave_search = bool(deterministic and workers > 1)
    ps.parameters.random_seed = int(seed)


def _neighbourhood_polish(m, nodes, start, makespan, cur, cur_mk, lb, fractions, set_params, info, unit):
    """Tail polish of a complete solution ``cur`` (node → start, makespan ``cur_mk``) by CP-SAT: for
    each fraction f, a copy of the model with the operations starting before f × makespan fixed at
    their times and the rest re-optimised from the hint (a small model).  The incumbent satisfies
    every added constraint, so a step never makes it worse; a step's better solution is kept.
    Returns (cur, cur_mk)."""
    from ortools.sat.python import cp_model

    for frac in fractions:
        sub = m.Clone()
        var = lambda v: sub.GetIntVarFromProtoIndex(start[v].Index())  # noqa: E731
        for v in nodes:
            if cur[v] < frac * cur_mk:
                sub.Add(var(v) == cur[v])
        sub.ClearHints()
        for v in nodes:
            sub.AddHint(var(v), cur[v])
        sub.AddHint(sub.GetIntVarFromProtoIndex(makespan.Index()), cur_mk)
        ps = cp_model.CpSolver()
        set_params(ps)
        status = solve(ps, sub)
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) and ps.ObjectiveValue() < cur_mk:
            cur = {v: ps.Value(start[v]) for v in nodes}
            cur_mk = int(round(ps.ObjectiveValue()))
        info.append((frac, to_ms(cur_mk * unit), round(ps.WallTime(), 2)))
        if cur_mk <= lb:
            break
    return cur, cur_mk


def solve_optimal(
    profile,
    *,
    wave: bool = False,
    memory_limit: int | float | Sequence[float] | None = None,
    time_limit_s: float = 60.0,
    workers: int = 1,
    microbatch_order: bool = True,
    hint: bool = True,
    validate: bool = True,
    deterministic: bool = True,
) -> OptimalResult:
    """CP-SAT optimum (§4.1) for a :class:`~titan_ext.plan.PipelineProfile` (one stage per rank, or
    V-shape with ``wave=True``).  ``memory_limit``: per-rank in-flight activation limit, as for
    :func:`titan_ext.plan.crosspipe.plan_crosspipe`.  The returned plan has passed validation."""
    profile_arg(profile)
    _check_solver_args(time_limit_s, workers, {"wave": wave, "microbatch_order": microbatch_order, "hint": hint,
                                                "validate": validate, "deterministic": deterministic})
    problem = placed_from_profile(profile, "wave" if wave else "ud", memory_limit)
    result = solve_optimal_problem(
        problem, time_limit_s=time_limit_s, workers=workers, microbatch_order=microbatch_order, hint=hint,
        deterministic=deterministic,
    )
    if validate and result.actions is not None:
        from .validate import validate_plan

        validate_plan(result.actions, problem.num_stages, problem.num_microbatches,
                      inflight_limit=problem.per_stage_limit(), release=problem.release)
    return result
