"""Optimal pipeline schedules: CrossPipe's constraint model (§4.1) solved with OR-Tools CP-SAT.

Model (CrossPipe §4.1, in integer time units of ``time_unit_ms``):

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
  loses nothing: every operation depends on it) to the last end on any rank.

The result's ``makespan_ms`` is the best solution found, ``bound_ms`` CP-SAT's proven lower bound
(equal when ``proven``).  The solution's per-rank order is returned as a torch-IR plan.  Any plan
timed by :func:`titan_ext.plan.simulate` in delegated mode is a feasible solution of this model (the
simulator sends messages FIFO, the model may also reorder them), so ``bound_ms`` ≤ the simulated
makespan of every plan that respects the memory limit (and, with ``microbatch_order``, keeps each
(stage, type) in microbatch order, as all our generators do).

OR-Tools is an optional extra (``pip install titan-ext[solver]``); it is imported inside
:func:`solve_optimal` only, so ``import titan_ext.plan`` stays light.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Sequence

from .crosspipe import F, I, W, CrossPipeProblem, Op, plan_crosspipe_problem, problem_from_profile, replay, to_actions

__all__ = ["OptimalResult", "solve_optimal", "solve_optimal_problem", "time_unit_for"]


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

    @property
    def gap(self) -> float | None:
        """Relative gap (best − bound) / best of this solve."""
        if self.makespan_ms is None or self.makespan_ms <= 0:
            return None
        return (self.makespan_ms - self.bound_ms) / self.makespan_ms


def time_unit_for(values: Sequence[float], finest_ms: float = 1e-3) -> float:
    """The coarsest time unit (in ms, a power of ten ≥ ``finest_ms``, at most 1 ms) in which every
    value is an integer; ``finest_ms`` (rounding) when none is."""
    unit = 1.0
    while unit >= finest_ms * (1 - 1e-9):
        if all(abs(v / unit - round(v / unit)) < 1e-6 for v in values):
            return unit
        unit /= 10
    return finest_ms


def solve_optimal_problem(
    problem: CrossPipeProblem,
    *,
    time_limit_s: float = 60.0,
    workers: int = 1,
    microbatch_order: bool = True,
    hint: bool = True,
    time_unit_ms: float | None = None,
    random_seed: int = 0,
    log: bool = False,
) -> OptimalResult:
    """Solve CrossPipe §4.1 for ``problem`` with CP-SAT (see the module docstring).

    ``hint``: start from the best CrossPipe greedy plan (faster first solution, same optimum).
    ``time_unit_ms``: integer time grid; default: the coarsest power of ten that represents every
    duration exactly (durations are rounded to it otherwise).
    """
    try:
        from ortools.sat.python import cp_model
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("the optimal solver needs OR-Tools: pip install 'titan-ext[solver]'") from e

    t_start = time.perf_counter()
    R, N, S = problem.num_ranks, problem.num_microbatches, problem.num_stages
    s2r = problem.stage_to_rank
    all_values = list(problem.f_ms) + list(problem.b_ms) + list(problem.w_ms)
    all_values += [problem.latency(b) for b in range(S - 1)] + [problem.transfer(b) for b in range(S - 1)]
    unit = time_unit_ms if time_unit_ms is not None else time_unit_for(all_values)
    q = lambda ms: int(round(ms / unit))  # noqa: E731
    dur = {F: [q(x) for x in problem.f_ms], I: [q(x) for x in problem.b_ms], W: [q(x) for x in problem.w_ms]}
    lat = [q(problem.latency(b)) for b in range(S - 1)]
    tx = [q(problem.transfer(b)) for b in range(S - 1)]

    # ---- greedy hint and horizon
    hint_orders = None
    hint_ms = None
    if hint:
        wave_shape = any(problem.stage_to_rank.count(r) > 1 for r in range(R))
        try:
            greedy = plan_crosspipe_problem(problem, "wave" if wave_shape else "udsub", convert=False)
        except ValueError:
            greedy = None
        if greedy is not None:
            hint_orders = replay(problem, greedy.orders)
            hint_ms = hint_orders.makespan_ms
    total = sum(dur[k][s] for s in range(S) for k in (F, I, W)) * N
    comm = sum(lat) + sum(tx)
    horizon = total + 2 * N * (comm + 1) + 1
    if hint_orders is not None:
        # the greedy timing may be off the integer grid by rounding; keep slack
        horizon = min(horizon, q(hint_ms) + 5 * S * N + 1)  # + rounding slack (≤ 1 unit per op/message)

    m = cp_model.CpModel()
    start: dict[Op, object] = {}
    end: dict[Op, object] = {}
    rank_intervals: list[list] = [[] for _ in range(R)]
    # earliest start from the F chain (a valid domain lower bound, helps propagation)
    head = [0] * S
    for s in range(1, S):
        hop = problem.hop(s - 1, s)
        head[s] = head[s - 1] + dur[F][s - 1] + (0 if hop is None else lat[s - 1] + tx[s - 1])
    for s in range(S):
        r = s2r[s]
        for mb in range(N):
            for k in (F, I, W):
                op = (s, k, mb)
                lo = head[s] if k == F else head[s] + dur[F][s]
                st = m.NewIntVar(lo, horizon, f"t_{s}{k}{mb}")
                start[op] = st
                end[op] = st + dur[k][s]
                rank_intervals[r].append(m.NewFixedSizeIntervalVar(st, dur[k][s], f"iv_{s}{k}{mb}"))
    m.Add(start[(0, F, 0)] == 0)

    channel_intervals: dict[tuple[int, int], list] = {}
    num_messages = 0

    def dependency(src: Op, dst: Op, boundary: int | None) -> None:
        nonlocal num_messages
        hop = None if boundary is None else problem.hop(src[0], dst[0])
        if hop is None:
            m.Add(start[dst] >= end[src])
            return
        b, channel = hop
        num_messages += 1
        if tx[b] > 0:
            c = m.NewIntVar(0, horizon, f"c_{src[0]}{src[1]}{src[2]}")
            m.Add(c >= end[src])
            channel_intervals.setdefault(channel, []).append(m.NewFixedSizeIntervalVar(c, tx[b], f"civ_{src}"))
            m.Add(start[dst] >= c + tx[b] + lat[b])
        else:
            m.Add(start[dst] >= end[src] + lat[b])

    for mb in range(N):
        for s in range(S):
            if s < S - 1:
                dependency((s, F, mb), (s + 1, F, mb), s)
                dependency((s + 1, I, mb), (s, I, mb), s)
            else:
                m.Add(start[(s, I, mb)] >= end[(s, F, mb)])
            m.Add(start[(s, W, mb)] >= end[(s, I, mb)])
    for r in range(R):
        m.AddNoOverlap(rank_intervals[r])
    for ivs in channel_intervals.values():
        m.AddNoOverlap(ivs)
    if microbatch_order:
        for s in range(S):
            for k in (F, I, W):
                for mb in range(N - 1):
                    m.Add(start[(s, k, mb + 1)] >= end[(s, k, mb)])

    # ---- memory (per rank): activation of (s, mb) held from the start of F to the end of I
    # (|M_D| units) and, for the part W keeps, to the end of W (|M_W| units)
    if problem.memory_limit is not None:
        mf, mi, mw = problem.memory_deltas
        fr = [Fraction(x).limit_denominator(1000) for x in (mf, -mi, -mw) + tuple(problem.memory_limit)]
        den = math.lcm(*(x.denominator for x in fr))
        d_i, d_w = int(fr[1] * den), int(fr[2] * den)
        for r in range(R):
            cap = int(math.floor(fr[3 + r] * den + 1e-9))
            ivs, demands = [], []
            for s in range(S):
                if s2r[s] != r:
                    continue
                for mb in range(N):
                    if d_i:
                        size = m.NewIntVar(0, horizon, "")
                        ivs.append(m.NewIntervalVar(start[(s, F, mb)], size, end[(s, I, mb)], f"act_{s}_{mb}"))
                        demands.append(d_i)
                    if d_w:
                        size = m.NewIntVar(0, horizon, "")
                        ivs.append(m.NewIntervalVar(start[(s, F, mb)], size, end[(s, W, mb)], f"actw_{s}_{mb}"))
                        demands.append(d_w)
            if ivs:
                m.AddCumulative(ivs, demands, cap)

    # ---- objective: makespan from the first F on stage 0 (= 0) to the last end anywhere
    makespan = m.NewIntVar(0, horizon, "makespan")
    for s in range(S):
        for mb in range(N) if not microbatch_order else (N - 1,):
            m.Add(makespan >= end[(s, W, mb)])
    # redundant per-rank bound: the rank cannot start before its first F can arrive, then has all
    # its work to do (valid, tightens the initial bound)
    for r in range(R):
        stages = [s for s in range(S) if s2r[s] == r]
        work = N * sum(dur[k][s] for s in stages for k in (F, I, W))
        m.Add(makespan >= min(head[s] for s in stages) + work)
    m.Minimize(makespan)

    if hint_orders is not None:
        for op, t in hint_orders.start_ms.items():
            m.AddHint(start[op], q(t))

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = int(random_seed)
    solver.parameters.log_search_progress = bool(log)
    status = solver.Solve(m)
    solve_s = time.perf_counter() - t_start
    name = solver.StatusName(status)
    num_ops = 3 * N * S
    params = {"time_limit_s": time_limit_s, "workers": workers, "microbatch_order": microbatch_order, "hint": hint}
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return OptimalResult(name, False, None, solver.BestObjectiveBound() * unit, None, None, None, solve_s,
                             unit, num_ops, num_messages, hint_ms, params)
    starts = {op: solver.Value(v) for op, v in start.items()}
    orders: dict[int, list[Op]] = {r: [] for r in range(R)}
    kind_rank = {F: 0, I: 1, W: 2}
    for op in sorted(starts, key=lambda o: (starts[o], starts[o] + dur[o[1]][o[0]], kind_rank[o[1]], o[2])):
        orders[s2r[op[0]]].append(op)
    best = solver.ObjectiveValue() * unit
    bound = solver.BestObjectiveBound() * unit
    return OptimalResult(
        status=name,
        proven=status == cp_model.OPTIMAL,
        makespan_ms=best,
        bound_ms=bound,
        orders=orders,
        actions=to_actions(orders),
        start_ms={op: t * unit for op, t in starts.items()},
        solve_s=solve_s,
        time_unit_ms=unit,
        num_ops=num_ops,
        num_messages=num_messages,
        hint_ms=hint_ms,
        params=params,
    )


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
) -> OptimalResult:
    """CP-SAT optimum (§4.1) for a :class:`~titan_ext.plan.PipelineProfile` (one stage per rank, or
    V-shape with ``wave=True``).  ``memory_limit``: per-rank in-flight activation limit, as for
    :func:`titan_ext.plan.crosspipe.plan_crosspipe`.  The returned plan has passed validation."""
    problem = problem_from_profile(profile, "wave" if wave else "ud", memory_limit)
    result = solve_optimal_problem(
        problem, time_limit_s=time_limit_s, workers=workers, microbatch_order=microbatch_order, hint=hint
    )
    if validate and result.actions is not None:
        from .validate import validate_plan

        per_stage = None
        if problem.memory_limit is not None and not wave:
            per_stage = [int(math.floor(x + 1e-9)) for x in problem.memory_limit]
        validate_plan(result.actions, problem.num_stages, problem.num_microbatches, inflight_limit=per_stage)
    return result
