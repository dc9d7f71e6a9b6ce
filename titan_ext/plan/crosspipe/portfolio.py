"""CrossPipe planner: the portfolio of Alg.1 runs (CrossPipe §4.2), the selection by simulation
(§6.2: "a schedule with the best simulation performance is selected") and our local search on top.

Input: a :class:`~titan_ext.plan.placed.PlacedProfile` (:func:`plan_crosspipe_placed`) or a
:class:`~titan_ext.plan.PipelineProfile` and a variant (:func:`plan_crosspipe`).  Every member is timed
by ``simulate``'s model (:class:`.retime.Retimer` / ``_search.c``, integer ns, bit-identical to
``simulate``), so the selection compares exact makespans.

Two paths, both deterministic for a given budget: the compiled one (``_compiled``: more members,
descents and annealing) where the C modules are built, the pure-Python one otherwise.  Tuning
constants: :data:`.tuning.TUNING`.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

from ..placed import PlacedProfile
from ..timing import to_ms
from . import _compiled
from .greedy import greedy_schedule
from .retime import Retimer
from .search import local_search
from .variants import CROSSPIPE_VARIANTS, F, I, W, Op, placed_from_profile, to_actions, wave_stage_to_rank
from .tuning import DEFAULT_BUDGET, TUNING

T = TUNING


class Member(NamedTuple):
    """One portfolio member: an Alg.1 configuration (or a ready-made order, then n_sub = 0)."""

    caps: str
    """name of the per-rank in-flight cap vector ("limit": the memory limit alone; "zbv": torch's ZBV)."""
    n_sub: int
    steady: str
    reserve: str | int
    lookahead: bool


class TimedMember(NamedTuple):
    """A member tried and the simulated makespan of its plan in ns (inf: no schedule under its caps)."""

    caps: str
    n_sub: int
    steady: str
    reserve: str | int
    lookahead: bool
    makespan_ns: int | float

    @property
    def makespan_ms(self) -> float:
        return to_ms(self.makespan_ns)


class _Entry(NamedTuple):
    """A member's plan in the pool (sorted by makespan, then by the order it was made)."""

    makespan_ns: int
    index: int
    member: Member
    greedy_makespan_ns: int
    ids: list


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
    makespan_ns: int
    """makespan of the whole-action plan under ``simulate``'s model (ns)."""
    greedy_makespan_ns: int
    """makespan of the greedy's own (sub-block) timeline (ns)."""
    memory_limit: tuple[float, ...] | None
    peak_memory: list[float]
    plan_ms: float
    candidates: list[TimedMember] = field(default_factory=list)
    """every portfolio member tried."""
    improved: bool = False
    """whether the local search (or the polish) improved the best member (then ``orders`` differ from its
    greedy plan)."""
    polish: dict | None = None
    """the CP-SAT polish's report (``titan_ext.plan.polish``), None when the plan was not polished."""

    @property
    def makespan_ms(self) -> float:
        return to_ms(self.makespan_ns)

    @property
    def greedy_makespan_ms(self) -> float:
        return to_ms(self.greedy_makespan_ns)


@dataclass
class _Run:
    """What one planner call shares between its phases."""

    problem: PlacedProfile
    variant: str
    model: Retimer
    limit: tuple
    deadline: float | None
    tried: list = field(default_factory=list)
    pool: list = field(default_factory=list)
    error: ValueError | None = None

    def late(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline

    def greedy_cost(self, n_sub: int, unit: int) -> int:
        """Alg.1 steps of one member (3·N·S plus the extra W sub-blocks) × ``unit``."""
        p = self.problem
        return unit * (3 * p.num_microbatches * p.num_stages + (n_sub - 1) * p.num_microbatches * p.num_stages)

    def add(self, member: Member, makespan: float, greedy_makespan: float, ids) -> None:
        self.tried.append(TimedMember(*member, makespan))
        if makespan < math.inf:
            self.pool.append(_Entry(makespan, len(self.pool), member, greedy_makespan, ids))

    def add_extra(self, extra: Mapping[str, Mapping[int, Sequence[Op]]] | None, time_ids: Callable) -> None:
        """Ready-made orders as members (a member above the memory limit, or missing a rank, is skipped)."""
        R = self.problem.num_ranks
        for name, orders in (extra or {}).items():
            if any(r not in orders for r in range(R)):
                continue
            if any(pk > lim + 1e-9 for pk, lim in zip(self.problem.peak_memory(orders), self.limit)):
                continue
            ids = self.model.ids(orders)
            mk = time_ids(ids)
            self.add(Member(name, 0, "", 0, False), mk, mk, ids)

    def best(self) -> _Entry:
        if not self.pool:
            raise self.error
        self.pool.sort(key=lambda x: (x[0], x[1]))
        return self.pool[0]

    def plan(self, best: _Entry, ids, makespan: float, improved: bool, convert: bool, t0: float) -> CrossPipePlan:
        orders = self.model.ops(ids)
        m = best.member
        return CrossPipePlan(
            actions=to_actions(orders) if convert else {}, orders=orders, stage_to_rank=self.problem.stage_to_rank,
            variant=self.variant, n_sub=m.n_sub, steady=m.steady, reserve=m.reserve, lookahead=m.lookahead,
            caps=m.caps, makespan_ns=makespan, greedy_makespan_ns=best.greedy_makespan_ns,
            memory_limit=self.problem.memory_limit, peak_memory=self.problem.peak_memory(orders),
            plan_ms=(time.perf_counter() - t0) * 1e3, candidates=self.tried, improved=improved,
        )


# ----------------------------------------------------------------------------- members
def _as_tuple(v, default):
    if v is None:
        return default
    if isinstance(v, (str, int)):
        return (v,)
    return tuple(v)


def _axes(variant: str, portfolio: bool, n_sub, steady, reserve, lookahead) -> tuple:
    """(n_subs, steady rules, reserves, lookaheads) of the portfolio; one of each without it."""
    if portfolio:
        subs = _as_tuple(n_sub, {"ud": (1,), "udsub": (1, 2, 4), "wave": (1,)}[variant])
        steadies = _as_tuple(steady, ("interleave", "backward_first"))
        reserves = _as_tuple(reserve, (1, 2, 4, "pending") if variant == "wave" else (1,))
        lookaheads = (lookahead,) if isinstance(lookahead, bool) else _as_tuple(lookahead, (False, True))
    else:
        subs = _as_tuple(n_sub, {"ud": (1,), "udsub": (2,), "wave": (1,)}[variant])
        steadies = _as_tuple(steady, ("interleave",))
        reserves = _as_tuple(reserve, (1,))
        lookaheads = (lookahead,) if isinstance(lookahead, bool) else _as_tuple(lookahead, (False,))
    if variant == "ud" and subs != (1,):
        raise ValueError("CrossUD is the n_sub = 1 variant; use 'udsub' for sub-blocks")
    return subs, steadies, reserves, lookaheads


def _check_axes(axes: tuple) -> None:
    """The portfolio's knobs as given: n_sub integers >= 1, steady rules by name, reserves integers >= 1
    or "pending", lookaheads booleans (ValueError naming the knob)."""
    from ...args import bool_arg, int_arg

    subs, steadies, reserves, lookaheads = axes
    for v in subs:
        int_arg(v, "n_sub", 1)
    for v in steadies:
        if v not in ("interleave", "backward_first"):
            raise ValueError(f"steady must be 'interleave' or 'backward_first', got {v!r}")
    for v in reserves:
        if v != "pending":
            int_arg(v, "reserve", 1)
    for v in lookaheads:
        bool_arg(v, "lookahead")


def _check_variant(problem: PlacedProfile, variant: str) -> None:
    if variant not in CROSSPIPE_VARIANTS:
        raise ValueError(f"variant must be one of {CROSSPIPE_VARIANTS}, got {variant!r}")
    wave_shape = any(problem.stage_to_rank.count(r) > 1 for r in range(problem.num_ranks))
    if variant == "wave" and not wave_shape:
        raise ValueError("variant 'wave' needs a V-shape problem (two stages per rank)")
    if variant in ("ud", "udsub") and wave_shape:
        raise ValueError(f"variant {variant!r} needs one stage per rank")


def _cap_problems(problem: PlacedProfile, caps: Mapping[str, Sequence[float]] | None) -> dict:
    """name → problem with that per-rank in-flight cap vector (clipped to the memory limit); "limit":
    the memory limit alone.  Duplicates and caps below one microbatch per stage are dropped."""
    problems = {"limit": problem}
    base = problem.memory_limit or (math.inf,) * problem.num_ranks
    for name, cap in (caps or {}).items():
        if len(cap) != problem.num_ranks:
            raise ValueError(f"caps[{name!r}] has {len(cap)} entries, expected one per rank ({problem.num_ranks})")
        limit = tuple(float(min(b, c)) for b, c in zip(base, cap))
        if limit != problem.memory_limit and all(limit != p.memory_limit for p in problems.values()):
            try:
                problems[name] = problem.with_memory_limit(limit)
            except ValueError:  # a cap below one microbatch per stage: not a usable member
                pass
    return problems


def _members(problems, axes, variant: str) -> list[Member]:
    """The product of caps × n_sub × reserve × steady × lookahead, the tuned priority members first
    (then product order)."""
    subs, steadies, reserves, lookaheads = axes
    members = [Member(c, ns, st, rs, la) for c in problems for ns in subs for rs in reserves for st in steadies
               for la in lookaheads]
    prio = {m: i for i, m in enumerate(T.wave_priority if variant == "wave" else T.ud_priority)}
    members.sort(key=lambda m: prio.get(m, len(prio)))  # stable: product order after
    return members


def _cap_vectors(problem: PlacedProfile, problems: Mapping[str, PlacedProfile]):
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


def _ud_members(problem, problems, members, axes, pool):
    """The compiled path's UD members, (member, problem), in the order they are generated (while the
    budget lasts): the named cap vectors with the first steady rule (interleave) and every ``n_sub``;
    then, with the (steady rule, n_sub) of the best plan so far first, the cap neighbours
    (:func:`_cap_vectors`) and the named vectors with the other combinations; the lookahead members
    last.  ``pool`` is the list of :class:`_Entry` timed so far."""
    subs, steadies = axes[0], axes[1]
    named, neighbours = _cap_vectors(problem, problems)
    combos = sorted(((st, ns) for st in steadies for ns in subs), key=lambda x: (x[0] != "interleave", x[1]))
    first = [c for c in combos if c[0] == combos[0][0]]
    for st, ns in first:
        for name, prob in named:
            yield Member(name, ns, st, 1, False), prob
    if pool:
        m0 = min(pool, key=lambda x: (x[0], x[1])).member
        combos.sort(key=lambda c: c != (m0.steady, m0.n_sub))
    for st, ns in combos:
        if (st, ns) not in first:
            for name, prob in named:
                yield Member(name, ns, st, 1, False), prob
        for name, prob in neighbours:
            yield Member(name, ns, st, 1, False), prob
    for m in members:
        if m.lookahead:
            yield m, problems[m.caps]


def _cap_neighbours(problem: PlacedProfile, problems: Mapping[str, PlacedProfile], member: Member):
    """(problem, member) for the cap-neighbour members of portfolio ``member``: its per-stage in-flight
    caps with one stage (not the last, whose F waits for nothing) lowered by one — one warm-up
    microbatch less on that stage — from the last but one stage back to stage 0 (the later stages'
    warm-up decides more of the bubble).  Caps below one in-flight microbatch are skipped."""
    base = problems[member.caps].memory_limit or problem.memory_limit
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
        yield prob_n, member._replace(caps=f"{member.caps}/s{s}-1")


# ----------------------------------------------------------------------------- pure-Python path
@dataclass
class _PyBudget:
    """The Python path's work account: greedy steps (× ``greedy_cost``) plus ``Model.work``."""

    model: Retimer
    budget: float
    unlimited: bool
    greedy_units: float = 0.0

    def used(self) -> float:
        return self.greedy_units + self.model.work


def _py_time(run: _Run, member: Member, prob: PlacedProfile, record_failure: bool = True) -> bool:
    """Alg.1 for one member, timed in the whole-action model; False when its caps admit no schedule."""
    try:
        g = greedy_schedule(prob, member.n_sub, member.steady, member.reserve, lookahead=member.lookahead)
    except ValueError as e:  # this member's memory rule admits no schedule
        if record_failure:
            run.tried.append(TimedMember(*member, math.inf))
            run.error = e
        return False
    ids = run.model.ids(g.orders)
    run.add(member, run.model.run(ids)[0], g.makespan_ns, ids)
    return True


def _py_members(run: _Run, problems, members, acct: _PyBudget, share: float) -> None:
    """Members in priority order while ``share`` of the budget lasts (at least one; CrossWave's
    priority members always, uncharged)."""
    n = run.model.n
    free = len(T.wave_priority) if run.variant == "wave" else 0
    for m in members:
        cost = run.greedy_cost(m.n_sub, T.greedy_cost) + n
        if len(run.tried) >= max(1, free) and not acct.unlimited and (
                acct.used() + cost > acct.budget * share or run.late()):
            break
        acct.greedy_units += cost - n if len(run.tried) >= free else -n
        _py_time(run, m, problems[m.caps])


def _py_neighbours(run: _Run, problems, acct: _PyBudget) -> set[str]:
    """The best member's cap neighbours (:func:`_cap_neighbours`), on ``neighbour_share`` · budget of
    extra work; returns the names of those that made a plan."""
    done_keys = {(problems[c.caps].memory_limit, c.n_sub, c.steady, c.lookahead) for c in run.tried}
    extra_work = math.inf if acct.unlimited else T.neighbour_share * acct.budget
    nb_budget = acct.used() + extra_work
    if not acct.unlimited:
        acct.budget += extra_work
    names = set()
    best = min(run.pool, key=lambda x: (x[0], x[1])).member
    for prob_n, m in _cap_neighbours(run.problem, problems, best):
        key = (prob_n.memory_limit, m.n_sub, m.steady, m.lookahead)
        if key in done_keys:
            continue
        done_keys.add(key)
        cost = run.greedy_cost(m.n_sub, T.greedy_cost) + run.model.n
        if acct.used() + cost > nb_budget or run.late():
            break
        acct.greedy_units += cost - run.model.n
        n_pool = len(run.pool)
        if _py_time(run, m, prob_n, record_failure=False) and len(run.pool) > n_pool:
            names.add(m.caps)
    return names


def _py_search(run: _Run, acct: _PyBudget, neighbour_names: set[str]) -> tuple:
    """Local search from the best members in turn while the budget lasts (distinct makespans only;
    the best cap neighbour first when it is within ``neighbour_first`` of the best member).
    Returns (start entry, ids, makespan, improved)."""
    pool = run.pool
    best, ids, mk, improved = pool[0], pool[0].ids, pool[0].makespan_ns, False
    starts = pool[:T.max_starts]
    nb = [x for x in pool if x.member.caps in neighbour_names]
    if nb and nb[0].makespan_ns <= pool[0].makespan_ns * (1 + T.neighbour_first):
        starts = [nb[0]] + [x for x in pool if x is not nb[0]][:T.max_starts - 1]
    seen_mk = set()
    for entry in starts:
        key = entry.makespan_ns
        if key in seen_mk:
            continue
        seen_mk.add(key)
        left = acct.budget - acct.used()
        if len(seen_mk) > 1 and (left < run.model.n * 8 or run.late()):
            break
        ids1, mk1, _ = local_search(run.model, [list(o) for o in entry.ids], run.limit, left, depth=T.depth,
                                    deadline=run.deadline)
        if mk1 < mk:
            best, ids, mk, improved = entry, ids1, mk1, True
    return best, ids, mk, improved


def _plan_python(run: _Run, problems, members, budget, portfolio: bool, search: bool, extra, convert, t0):
    """The pure-Python path of :func:`plan_crosspipe_placed`."""
    acct = _PyBudget(run.model, math.inf if budget is None else float(budget), budget is None or not portfolio)
    small = portfolio and run.variant != "wave" and run.problem.num_stages <= T.neighbour_max_stages
    _py_members(run, problems, members, acct, T.small_member_share if small else T.member_share)
    neighbour_names = _py_neighbours(run, problems, acct) if small and run.pool else set()
    run.add_extra(extra, lambda ids: run.model.run(ids)[0])
    best = run.best()
    ids, mk, improved = best.ids, best.makespan_ns, False
    if portfolio and search:
        best, ids, mk, improved = _py_search(run, acct, neighbour_names)
    return run.plan(best, ids, mk, improved, convert, t0)


# ----------------------------------------------------------------------------- compiled path
@dataclass
class _CBudget:
    """The compiled path's work account, in operations timed (``budget × compiled_scale``)."""

    total: float
    used: float

    @property
    def unlimited(self) -> bool:
        return self.total == math.inf

    def evals_left(self, share: float, n: int) -> int:
        """Timings of a whole plan that still fit in ``share`` of the budget."""
        if self.unlimited:
            return 1 << 40
        return int(max(0.0, self.total * share - self.used) // (n + T.eval_units))


def _c_members(run: _Run, todo, acct: _CBudget, eng, cap) -> None:
    """Alg.1 (``_greedy.c``) for each member of ``todo`` while ``c_member_share`` lasts (at least one)."""
    n = run.model.n
    for m, prob in todo:
        cost = run.greedy_cost(m.n_sub, T.greedy_c_units) + n + T.eval_units
        if run.pool and not acct.unlimited and (acct.used + cost > acct.total * T.c_member_share or run.late()):
            break
        acct.used += cost
        try:
            ids, gmk, _ = _compiled.greedy_ids(prob, m.n_sub, m.steady, m.reserve, "microbatch", m.lookahead)
        except ValueError as e:  # this member's memory rule admits no schedule
            run.tried.append(TimedMember(*m, math.inf))
            run.error = e
            continue
        run.add(m, eng.run(cap, ids, math.inf)[0], gmk, ids)


def _c_descents(run: _Run, acct: _CBudget, eng, cap) -> tuple[_Entry, list, float]:
    """Critical-path descents (``_search.c``; reference :func:`.search.local_search`) from the best
    ``c_starts`` distinct member plans while ``c_descent_share`` lasts; returns the best (entry, ids,
    makespan)."""
    best = run.pool[0]
    best_ids, best_mk = best.ids, best.makespan_ns
    n, seen_plans = run.model.n, set()
    for entry in run.pool:
        if len(seen_plans) >= T.c_starts:
            break
        key = hash(tuple(map(tuple, entry.ids)))  # members with other caps often give the very same plan
        if key in seen_plans:
            continue
        seen_plans.add(key)
        for long_moves in T.c_long_order:
            ev_cap = acct.evals_left(T.c_member_share + T.c_descent_share, n)
            if ev_cap < 1 or run.late():
                break
            ids1, mk1, ev = eng.descent(cap, entry.ids, run.limit, ev_cap, T.depth, long_moves, 1)
            acct.used += ev * (n + T.eval_units)
            if mk1 < best_mk:
                best, best_ids, best_mk = entry, ids1, mk1
    return best, best_ids, best_mk


def _c_anneal(run: _Run, acct: _CBudget, eng, cap, ids, mk: float) -> tuple[list, float]:
    """Annealing (reference :func:`.search.anneal`) with the rest of the budget, then a short descent;
    returns the better of (ids, mk) and its result."""
    evals = T.c_unlimited_anneal if acct.unlimited else acct.evals_left(1.0, run.model.n) - T.c_polish
    if evals < 1 or run.late():
        return ids, mk
    ids2, _, _ = eng.anneal(cap, ids, run.limit, evals, T.c_seed, T.c_temperature * mk, T.c_shift)
    ids2, mk2, _ = eng.descent(cap, ids2, run.limit, T.c_polish, T.depth, 1, 1)
    return (ids2, mk2) if mk2 < mk else (ids, mk)


def _plan_compiled(run: _Run, problems, members, axes, budget, extra, convert, t0) -> CrossPipePlan:
    """The compiled path of :func:`plan_crosspipe_placed` (our addition to Alg.1, §4.2):

    1. **members**: Alg.1 (``_greedy.c``, bit-identical to :func:`.greedy.greedy_schedule`) for every
       member of the portfolio, and — UD variants — for the *cap neighbours* of every named in-flight
       cap vector (:func:`_cap_vectors`: one stage, or every stage from one on, one warm-up microbatch
       shorter); each plan timed in the whole-action model;
    2. **descent** (critical-path local search with the long W moves and the gap filling of
       :func:`.search.critical_moves`) from the best ``c_starts`` members;
    3. **annealing** from the best plan so far, then a short descent.

    All of it in deterministic units (operations timed; ``budget × compiled_scale``): members while
    ``c_member_share`` lasts, descents while ``c_descent_share`` lasts, annealing with the rest."""
    eng = _compiled.engine()
    cap = eng.model(run.model.spec())
    acct = _CBudget(math.inf if budget is None else float(budget) * T.compiled_scale, float(T.setup_units * run.model.n))
    if run.variant == "wave":
        todo = [(m, problems[m.caps]) for m in members]
    else:
        todo = _ud_members(run.problem, problems, members, axes, run.pool)
    _c_members(run, todo, acct, eng, cap)
    run.add_extra(extra, lambda ids: eng.run(cap, ids, math.inf)[0])
    first = run.best()
    best, ids, mk = _c_descents(run, acct, eng, cap)
    ids, mk = _c_anneal(run, acct, eng, cap, ids, mk)
    return run.plan(best, ids, mk, mk < first.makespan_ns, convert, t0)


# ----------------------------------------------------------------------------- planner API
def plan_crosspipe_placed(
    problem: PlacedProfile,
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
    """CrossUD (``n_sub = 1``), CrossUDSub (``n_sub`` > 1) or CrossWave (V-shape placement) plan of
    ``problem``, a :class:`~titan_ext.plan.placed.PlacedProfile` (times in integer ns).

    ``portfolio=False``: one run of Alg.1 as the paper states it — steady phase interleaving F and D,
    no lookahead, the memory limit as the only cap; ``n_sub`` = 1 (CrossUD) or 2 (CrossUDSub), V-turn
    reserve 1 (CrossWave); no local search.

    ``portfolio=True`` (default): parameters left at None form a portfolio (CrossPipe §6.2: "a schedule
    with the best simulation performance is selected"): steady ∈ {interleave, backward_first} ×
    lookahead ∈ {off, on} × the per-rank in-flight caps in ``caps`` (name → per-rank limit, each
    clipped to the memory limit; the memory limit alone is always one member) × n_sub ∈ {1, 2, 4}
    (CrossUDSub) × V-turn reserve ∈ {1, 2, 4, "pending"} (CrossWave), tried in a fixed priority order
    (``TUNING.ud_priority`` first).  ``extra`` adds ready-made orders as members (name → rank → ops; e.g.
    torch's ZBV for CrossWave; a member above the memory limit or one that deadlocks is skipped).
    On UD problems with at most ``TUNING.neighbour_max_stages`` stages, the best member's *cap neighbours*
    (:func:`_cap_neighbours`: its per-stage in-flight caps with one stage lowered by one, i.e. one
    warm-up microbatch less there) are members too, on ``neighbour_share`` · budget of extra work;
    there the members get ``small_member_share`` of the budget.
    Then the best member is improved by :func:`.search.local_search` (``search=True``): moves of single
    operations around the critical path, kept when the replayed makespan drops and memory stays
    within the limit (the best cap neighbour is searched first when it is within ``neighbour_first``
    of the best member).

    ``budget`` (operations replayed, see ``DEFAULT_BUDGET``) bounds the work: members are generated in
    priority order while at most half the budget is spent (always at least one), the local search gets
    the rest.  The result is deterministic for a given budget.  ``budget=None``: every member, then
    the local search until no move improves.  ``time_budget_ms`` additionally stops both phases at a
    wall-clock deadline (not deterministic; off by default).

    ``engine=True`` (default): where the compiled modules are built (``_compiled.available()``), the portfolio
    and search run on them instead (:func:`_plan_compiled`: more members, descents and annealing for
    the same budget; a different, also deterministic, plan); ``engine=False`` forces the Python path.
    """
    t0 = time.perf_counter()
    from ...args import bool_arg, real_arg

    if not isinstance(problem, PlacedProfile):
        from ...args import ArgumentTypeError
        raise ArgumentTypeError(f"problem must be a PlacedProfile, got {type(problem).__name__}")
    for name, value in (("portfolio", portfolio), ("convert", convert), ("search", search), ("engine", engine)):
        bool_arg(value, name)
    real_arg(budget, "budget", positive=True, optional=True)
    real_arg(time_budget_ms, "time_budget_ms", positive=True, optional=True)
    _check_variant(problem, variant)
    axes = _axes(variant, portfolio, n_sub, steady, reserve, lookahead)
    _check_axes(axes)
    problems = _cap_problems(problem, caps if portfolio else None)
    members = _members(problems, axes, variant)
    run = _Run(problem, variant, Retimer(problem), tuple(problem.memory_limit or (math.inf,) * problem.num_ranks),
               None if time_budget_ms is None else t0 + time_budget_ms / 1e3)
    if portfolio and search and engine and _compiled.available() and _compiled.exact_in_c(problem):
        return _plan_compiled(run, problems, members, axes, budget, extra, convert, t0)
    return _plan_python(run, problems, members, budget, portfolio, search, extra, convert, t0)


def _warmup_caps(profile, problem: PlacedProfile) -> dict[str, list[float]]:
    """Per-stage in-flight caps from PipeMorph's warm-up planning (Alg.1 under the memory limit; Alg.2
    from the profile's delays with slack floor 2 and 1), used as extra portfolio members of the UD
    variants: the greedy then decides the order, the caps how far each stage may run ahead."""
    from ..warmup import adapted_warmup_counts, initial_warmup_counts_for

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
        from ..builtin import builtin_plan
        from ..ir import as_ops

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
    in-flight activation limit (see :func:`.variants.placed_from_profile`).  ``budget`` / ``time_budget_ms``: see
    :func:`plan_crosspipe_placed`.  ``zbv`` (CrossWave): torch's ZBV order is one more portfolio member
    (when it fits the memory limit), so CrossWave is never slower than ZBV at ZBV's memory (the order
    comes from torch, imported lazily; skipped when torch is unavailable).  The returned plan has passed
    :func:`titan_ext.plan.validate_plan` (torch lowering + dry run included) unless ``validate=False``.
    """
    t0 = time.perf_counter()
    problem = placed_from_profile(profile, variant, memory_limit)
    caps = None
    extra = None
    if portfolio and variant != "wave":
        caps = _warmup_caps(profile, problem)
    if portfolio and variant == "wave" and zbv:
        order = _zbv_orders(problem.num_ranks, problem.num_microbatches)
        if order is not None:
            extra = {"zbv": order}
    plan = plan_crosspipe_placed(problem, variant, n_sub=n_sub, steady=steady, reserve=reserve,
                                  lookahead=lookahead, caps=caps, portfolio=portfolio, budget=budget,
                                  time_budget_ms=time_budget_ms, extra=extra)
    if validate:
        from ..validate import validate_plan

        validate_plan(plan.actions, problem.num_stages, problem.num_microbatches,
                      inflight_limit=problem.per_stage_limit(), release=problem.release)
    plan.plan_ms = (time.perf_counter() - t0) * 1e3
    return plan
