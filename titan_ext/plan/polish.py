"""Bounded CP-SAT polish of a plan (docs/optimality.md): a CrossPipe greedy + search plan (CrossPipe §4.2
with our portfolio and local search; :func:`polish_crosspipe`) or any split-backward plan with one stage
per rank — PipeMorph's Alg.1/2 plans included (:func:`polish_plan`) — improved within a per-call budget of
``budget_s`` seconds, in two stages.

1. **CP-SAT stage**: CrossPipe §4.1's constraint model (:func:`titan_ext.plan.optimal.solve_optimal_problem`
   with ``hint_orders`` = the plan): the plan's last W's deferred to the end of their rank where that
   shortens it (W has no successor); large-neighbourhood steps — the operations starting before a
   fraction f ∈ ``POLISH_TAIL`` of the makespan fixed at their times, the rest re-optimised (the
   cool-down, where the last microbatch's backward chain is critical and the greedy loses its time);
   then a short search of the whole model.  One worker, seed 0, deterministic time limits
   (``POLISH_CPSAT_SHARE`` × ``budget_s`` work units in all).
2. **search stage**: CrossPipe's compiled descent, annealing and descent (``_search.c``) from the CP-SAT
   stage's plan, ``POLISH_SEARCH_UNITS_PER_S`` × ``budget_s`` operations timed (at most
   ``POLISH_MAX_EVALS`` timings); skipped when CP-SAT proved the plan optimal or the engine is not built.
   The CP-SAT stage moves the plan out of the search's basin; from there the search gets much further
   than from the greedy plan (docs/optimality.md).

Deterministic: the work is counted in deterministic units, so the result does not depend on the
machine's load; ``budget_s`` is calibrated as CPU seconds of one core of the 2-core benchmark VM (a 2 s
polish at S = 8, N = 32 used 1.4–2.0 s there, at load average 20–40).  Only the CP-SAT stage has a wall-clock safety net
(``POLISH_CPSAT_WALL`` × ``budget_s``, model building included), which binds only on a much slower or
busier machine (then the plan may differ; never worse, never invalid).  Problems with more than
``max_ops`` operations (3·N·S) are not polished: the model alone would eat the budget.

Input: the description every CrossPipe planner reads (a :class:`~titan_ext.plan.placed.PlacedProfile`
with one stage per rank); every makespan here is ``simulate``'s, in integer ns (``replay_makespan_ns``).

Guarantee (one rule, :func:`_accept`, for both entry points): a polished plan is returned only when our
validator accepts it (per-stage in-flight limit included, under the profile's memory rule
``profile.release``) and its makespan under the one simulator (``simulate.replay_makespan_ns``) is below
the input's; otherwise the input plan comes back unchanged.  Sits above ``optimal``, ``crosspipe`` and
``result``; ``schedules`` (``plan_by_name(..., polish_s=)``), the run-time planners (``polish_s``) and the
runtime's anytime polish (``PipeMorphConfig.polish_s``: :func:`polish_plan` in a background thread of a
running job, docs/runtime.md) call it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Mapping, Sequence

from .crosspipe import CrossPipePlan, Op, placed_from_profile, to_actions
from .ir import as_ops
from .placed import PlacedProfile
from .result import PlanResult, make_result
from .simulate import replay_makespan_ns
from .timing import to_ms
from .validate import PlanValidationError, validate_plan

__all__ = ["NO_SOLVER", "POLISH_MAX_OPS", "POLISH_TAIL", "load_solver", "polish_crosspipe", "polish_orders",
           "polish_plan"]

NO_SOLVER = "skipped: OR-Tools is not installed (pip install 'titan-ext[solver]')"
"""the report's status when the CP-SAT stage cannot run."""

POLISH_TAIL = (0.8, 0.6, 0.4)
"""neighbourhoods: the operations starting at or after f × makespan re-optimised, the rest fixed."""
POLISH_CPSAT_SHARE = 0.1
"""CP-SAT stage: deterministic work units (≈ seconds of one core here) per second of budget: half for
the tail steps, half for the final whole-model search."""
POLISH_CPSAT_WALL = 3.0
"""CP-SAT stage: its wall-clock limit as a multiple of the budget (model building included) — a safety
net for a machine much slower or busier than the calibration (the stage uses ≈ 0.2 × the budget in CPU
time, so the net binds only when it runs about 15× slower than on one free core); below that the
deterministic limits alone decide the result."""
POLISH_SEARCH_UNITS_PER_S = 1.5e8
"""search stage: operations timed per second of budget (≈ 8 ns each on the benchmark VM, so about a
third of the budget)."""
POLISH_MAX_EVALS = 400_000
"""search stage: at most this many plan timings (small problems reach their best long before)."""
POLISH_MAX_OPS = 1600
"""size bound (operations, 3·N·S): up to it a 2 s polish stays within its budget in CPU time on the
2-core benchmark VM (measured at load 20–40: S = 8, N = 32 ≤ 2.0 s; S = 16, N = 32, 1536 operations, 1.6 s).  Below
about 1 s of budget at S = 8, N = 32 the fixed costs (model, W deferral) make the CPU time exceed the
budget (0.5 s: ≤ 0.82 s; 1 s: ≤ 1.22 s; docs/optimality.md, "Budget vs quality")."""


def load_solver() -> bool:
    """Import what a polish runs (OR-Tools' CP-SAT module, the model builder, the compiled search) now;
    False when OR-Tools does not import.  The run-time polish calls it once at construction: importing
    CP-SAT takes ~0.5 s, much of it holding the GIL, which a polish thread would otherwise spend in the
    middle of training."""
    try:
        from ortools.sat.python import cp_model  # noqa: F401
    except ImportError:
        return False
    from . import optimal  # noqa: F401
    from .crosspipe import _compiled

    _compiled.engine()
    return True


def _check_budget(budget_s: float) -> None:
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not budget_s > 0 \
            or not math.isfinite(budget_s):
        raise ValueError(f"polish budget must be a number of seconds > 0, got {budget_s!r}")


def polish_orders(
    problem: PlacedProfile,
    orders: Mapping[int, Sequence[Op]],
    *,
    budget_s: float,
    max_ops: int = POLISH_MAX_OPS,
    seed: int = 0,
) -> tuple[dict[int, list[Op]] | None, dict]:
    """Polish the complete plan ``orders`` of ``problem`` (one stage per rank) within ``budget_s`` seconds
    (module docstring): the CP-SAT stage, then the search stage from its result.

    Returns (orders, report): orders is None unless a plan within the memory limit was found whose
    simulated makespan (``replay_makespan_ns``) is below the input's; report: ``status`` ("improved",
    "kept", or "skipped: why"), ``before_ms`` / ``cpsat_ms`` / ``after_ms`` (simulated: the input, after
    the CP-SAT stage, the result), ``bound_ms`` (CP-SAT's lower bound), ``solve_s``, ``budget_s``."""
    _check_budget(budget_s)
    if not isinstance(problem, PlacedProfile):
        from ..args import ArgumentTypeError
        raise ArgumentTypeError(f"problem must be a PlacedProfile, got {type(problem).__name__}")
    if any(r != s for s, r in enumerate(problem.stage_to_rank)):
        raise ValueError("the polish plans one stage per rank (stage r on rank r)")
    orders = as_ops(orders)
    problem.check_orders(orders)  # complete, split backwards, on their stages' ranks
    t0 = time.perf_counter()
    before_ns = replay_makespan_ns(as_ops(orders), problem.profile)
    before = to_ms(before_ns)
    report = {"status": "kept", "before_ms": before, "cpsat_ms": before, "after_ms": before,
              "budget_s": float(budget_s), "solve_s": 0.0}
    n_ops = 3 * problem.num_microbatches * problem.num_stages
    if n_ops > max_ops:
        report["status"] = f"skipped: {n_ops} operations > max_ops {max_ops}"
        return None, report
    try:
        best = _cpsat_stage(problem, orders, budget_s, seed, report, before_ns)
    except ImportError:
        report["status"] = NO_SOLVER
        return None, report
    report["cpsat_s"] = time.perf_counter() - t0
    if report["cpsat_ms"] > report.get("bound_ms", -math.inf):  # not proven optimal yet
        best = _search_stage(problem, best, budget_s, seed)
    report["solve_s"] = time.perf_counter() - t0
    after = replay_makespan_ns(as_ops(best), problem.profile)
    limit = problem.memory_limit or (math.inf,) * problem.num_ranks
    if after >= before_ns or any(pk > lim + 1e-9 for pk, lim in zip(problem.peak_memory(best), limit)):
        return None, report
    report.update(status="improved", after_ms=to_ms(after))
    return best, report


def _cpsat_stage(problem: PlacedProfile, orders, budget_s: float, seed: int, report: dict, before_ns: int) -> dict:
    """CP-SAT from ``orders`` (W deferral, tail neighbourhoods, a short whole-model search: one worker,
    deterministic time ``POLISH_CPSAT_SHARE`` × ``budget_s`` in all); returns the better plan.  Raises
    ImportError without OR-Tools."""
    from .optimal import solve_optimal_problem

    share = POLISH_CPSAT_SHARE * budget_s
    wall = POLISH_CPSAT_WALL * budget_s
    res = solve_optimal_problem(
        problem, hint_orders=orders, time_limit_s=wall, workers=1, random_seed=seed, deterministic=True,
        deterministic_time=share / 2, polish_step_dtime=share / (2 * len(POLISH_TAIL)), tail_polish=POLISH_TAIL)
    report["bound_ms"] = res.bound_ms
    if res.orders is None:
        return {r: list(o) for r, o in orders.items()}
    mk = replay_makespan_ns(as_ops(res.orders), problem.profile)
    report["cpsat_ms"] = to_ms(min(mk, before_ns))
    return res.orders if mk < before_ns else {r: list(o) for r, o in orders.items()}


def _search_stage(problem: PlacedProfile, orders, budget_s: float, seed: int) -> dict:
    """CrossPipe's compiled search from ``orders``: a critical-path descent, annealing, a descent
    (``_search.c``; references :func:`.crosspipe.search.local_search` / ``anneal``), with
    ``POLISH_SEARCH_UNITS_PER_S`` × ``budget_s`` operations timed in all; returns the best plan.  Skipped
    (``orders`` back) where the compiled engine is not built."""
    from .crosspipe import _compiled
    from .crosspipe.retime import Retimer
    from .crosspipe.tuning import TUNING

    eng = _compiled.engine()
    if eng is None or not _compiled.exact_in_c(problem):
        return orders
    model = Retimer(problem)
    cap = eng.model(model.spec())
    limit = tuple(problem.memory_limit or (math.inf,) * problem.num_ranks)
    evals = max(1, min(POLISH_MAX_EVALS, int(POLISH_SEARCH_UNITS_PER_S * budget_s / (model.n + TUNING.eval_units))))
    ids, mk, used = eng.descent(cap, model.ids(orders), limit, evals // 4, TUNING.depth, 1, 1)
    ids2, _, _ = eng.anneal(cap, ids, limit, max(1, evals - used - evals // 8), TUNING.c_seed + seed,
                            TUNING.c_temperature * mk, TUNING.c_shift)
    ids2, mk2, _ = eng.descent(cap, ids2, limit, max(1, evals // 8), TUNING.depth, 1, 1)
    return model.ops(ids2 if mk2 < mk else ids)


def polish_crosspipe(profile, plan: CrossPipePlan, *, budget_s: float, max_ops: int = POLISH_MAX_OPS,
                     seed: int = 0) -> CrossPipePlan:
    """``plan`` (CrossUD / CrossUDSub, one stage per rank, for ``profile``) polished within ``budget_s``
    seconds: a new plan when the polish passed :func:`~titan_ext.plan.validate_plan` under the plan's
    per-stage in-flight limit and is faster under the simulator, else ``plan`` itself.  Either way
    ``.polish`` holds the report of :func:`polish_orders` (its status "rejected: …" when the validator
    or the simulator refused the polished plan)."""
    if plan.variant not in ("ud", "udsub"):
        raise ValueError(f"the polish plans one stage per rank (crosspipe-ud, -udsub), got variant {plan.variant!r}")
    t0 = time.perf_counter()
    problem = placed_from_profile(profile, plan.variant, plan.memory_limit)
    orders, report = polish_orders(problem, plan.orders, budget_s=budget_s, max_ops=max_ops, seed=seed)
    out = plan
    if orders is not None:
        accepted = _accept(profile, problem, plan.orders, orders, report)
        if accepted is not None:
            new_ns = accepted
            out = dataclasses.replace(plan, actions=to_actions(orders), orders=orders, makespan_ns=new_ns,
                                      peak_memory=problem.peak_memory(orders), improved=True)
    return dataclasses.replace(out, polish=report, plan_ms=plan.plan_ms + (time.perf_counter() - t0) * 1e3)


def polish_plan(profile, plan: PlanResult, *, budget_s: float, memory_limit=None,
                max_ops: int = POLISH_MAX_OPS, seed: int = 0) -> PlanResult:
    """Any split-backward plan with one stage per rank (PipeMorph's, CrossPipe's, torch's ZB orders)
    polished within ``budget_s`` seconds: :func:`polish_orders` on the placed profile of ``profile``
    (:func:`~titan_ext.plan.crosspipe.placed_from_profile`, variant "ud") under ``memory_limit`` —
    per-stage in-flight activations, one number or one per stage; None: the plan's ``inflight_limit``
    (None there too: the profile's memory budget, else unlimited).

    Returns a new :class:`PlanResult` (``make_result``; ``source`` ends in "+polish") when the polished
    plan passed :func:`~titan_ext.plan.validate_plan` under that limit and the profile's memory rule and
    :func:`~titan_ext.plan.simulate.replay_makespan_ns` times it below ``plan``; else ``plan``'s fields
    unchanged (the same actions).  Either way ``info["polish"]`` holds the report of
    :func:`polish_orders` plus, when a polished plan was checked, ``sim_before_ms`` / ``sim_after_ms`` (the
    simulator's makespans the rule compared).  Plans with full backwards (B) or several stages per rank
    come back unchanged, status "skipped: …" (CrossPipe's model has F, I and W on one stage per rank); so
    does a plan already over ``memory_limit`` (the search starts from it: status "kept")."""
    _check_budget(budget_s)
    t0 = time.perf_counter()
    why = _unpolishable(plan)
    if why:
        return dataclasses.replace(plan, info={**plan.info, "polish": {"status": f"skipped: {why}",
                                                                       "budget_s": float(budget_s)}})
    limit = plan.inflight_limit if memory_limit is None else memory_limit
    problem = placed_from_profile(profile, "ud", limit)
    orders, report = polish_orders(problem, plan.ops, budget_s=budget_s, max_ops=max_ops, seed=seed)
    accepted = None if orders is None else _accept(profile, problem, plan.ops, orders, report)
    elapsed_ms = (time.perf_counter() - t0) * 1e3
    if accepted is None:
        return dataclasses.replace(plan, info={**plan.info, "polish": report})
    return make_result(
        as_ops(dict(sorted(orders.items()))), ops_checked=True, schedule=plan.schedule, source=f"{plan.source}+polish",
        predicted_makespan_ms=to_ms(accepted), plan_ms=plan.plan_ms + elapsed_ms, stage_to_rank=plan.stage_to_rank,
        profile=profile, inflight_limit=problem.per_stage_limit(), notes=list(plan.notes),
        candidates=dict(plan.candidates),
        info={**plan.info, "polish": report})


def _unpolishable(plan: PlanResult) -> str:
    """Why ``plan`` is outside the polish's model ("" when it is not)."""
    if plan.stages_per_rank != 1 or any(r != s for s, r in enumerate(plan.stage_to_rank)):
        return f"{plan.stages_per_rank} stages per rank (the polish plans stage r on rank r)"
    if any(kind == "B" for ops in plan.ops.values() for _, kind, _ in ops):
        return "full backward (B) operations (the polish plans split backwards: I and W)"
    return ""


def _accept(profile, problem: PlacedProfile, before: Mapping[int, Sequence[Op]],
            orders: Mapping[int, Sequence[Op]], report: dict) -> int | None:
    """The one acceptance rule of a polished plan (both polish entry points): ``orders`` passes
    :func:`validate_plan` under the problem's per-stage in-flight limit and ``profile``'s memory rule, and
    the simulator times it below ``before``.  Returns its makespan in ns, else None with
    ``report["status"]`` = "rejected: why".  Records the simulated makespans in ``report``."""
    try:
        validate_plan({r: list(o) for r, o in orders.items()}, problem.num_stages, problem.num_microbatches,
                      inflight_limit=problem.per_stage_limit(), release=profile.release)
    except PlanValidationError as e:
        report["status"] = f"rejected: the validator refused it: {e}"
        return None
    old = replay_makespan_ns(as_ops(before), profile)
    new = replay_makespan_ns(as_ops(orders), profile)
    report.update(sim_before_ms=to_ms(old), sim_after_ms=to_ms(new))
    if new >= old:
        report["status"] = f"rejected: simulated {to_ms(new):.3f} ms, not below the input's {to_ms(old):.3f} ms"
        return None
    return new
