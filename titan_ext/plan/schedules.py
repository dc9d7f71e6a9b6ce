"""Plan by name, above every planner: PipeMorph's schedules and ``auto``, the fastest of PipeMorph and
CrossPipe's greedy for the profile. Every name returns a :class:`PlanResult`.

``auto`` exists because the two planners win in different regimes: PipeMorph (§4.2) absorbs a slow
link with slackness, which Alg.2 clips at N − 2S, so with few microbatches (N ≤ 2S) it has no room;
CrossPipe's greedy (§4.2.2) reorders operations instead. Both plans are timed by the one simulator.

Also the by-name dispatch of CrossPipe's own schedules and the optimal solver (the CLI's and
scripts' entry). This module sits above ``crosspipe``, ``optimal`` and ``pipemorph`` in plan/'s
import order and nothing in plan/ imports it.
"""

from __future__ import annotations

import math
import time
from typing import Any

from ..args import ArgumentTypeError, bool_arg, int_arg, real_arg
from .profile import profile_arg
from .builtin import BUILTINS
from .crosspipe import plan_crosspipe, wave_profile
from .ir import as_ops, gc_paused, torch_schedules
from .optimal import solve_optimal
from .pipemorph import SCHEDULES, memory_caps, plan_pipemorph
from .polish import polish_crosspipe
from .profile import PipelineProfile
from .result import PlanResult, make_result
from .simulate import replay_makespan_ns
from .timing import to_ms
from .validate import PlanValidationError, validate_plan

__all__ = ["AUTO_SCHEDULES", "BUILTIN_SCHEDULES", "CROSSPIPE_SCHEDULES", "POLISH_SCHEDULES", "SCHEDULE_NAMES",
           "check_memory_limit", "plan_auto", "plan_by_name"]

AUTO_SCHEDULES = ("auto",) + SCHEDULES

POLISH_SCHEDULES = ("auto", "crosspipe-ud", "crosspipe-udsub")
"""the names ``polish_s`` applies to (CrossPipe plans with one stage per rank; ``titan_ext.plan.polish``)."""

CROSSPIPE_SCHEDULES = ("crosspipe-ud", "crosspipe-udsub", "crosspipe-wave", "optimal")

BUILTIN_SCHEDULES = tuple(BUILTINS)

SCHEDULE_NAMES = AUTO_SCHEDULES + CROSSPIPE_SCHEDULES + BUILTIN_SCHEDULES
"""every name :func:`plan_by_name` plans (one stage per rank; ``VIRTUAL_SCHEDULES`` with virtual stages)."""


def plan_auto(
    profile: PipelineProfile,
    *,
    memory_limit: int | None = None,
    mode: str = "auto",
    slack_floor: int = 2,
    validate: bool | str = True,
    backward: str = "split",
    polish_s: float | None = None,
    hold_margin: float = 0.0,
) -> PlanResult:
    """The faster of ``plan_pipemorph`` (its candidates included, ``hold_margin`` among them) and CrossPipe's
    CrossUD greedy, both held to the same per-stage in-flight limit; ties go to PipeMorph. CrossPipe plans
    split backwards only, so ``backward="full"`` is PipeMorph's plan. ``polish_s``: the CrossUD plan is
    polished within that many seconds first (:func:`~titan_ext.plan.polish.polish_crosspipe`; None: not)."""
    pm = plan_pipemorph(profile, mode=mode, slack_floor=slack_floor, memory_limit=memory_limit,
                        validate=validate, backward=backward, hold_margin=hold_margin)
    pm.schedule = "auto"
    if backward != "split":
        return pm
    torch_schedules()
    t0 = time.perf_counter()
    caps = memory_caps(profile, memory_limit)
    S, N = profile.num_stages, profile.num_microbatches
    with gc_paused():
        cp = plan_crosspipe(profile, "ud", memory_limit=caps, validate=False)
        if polish_s is not None:
            cp = polish_crosspipe(profile, cp, budget_s=polish_s)
        ops = as_ops(dict(sorted(cp.orders.items())))
        makespan = replay_makespan_ns(ops, profile)
        candidates = {**pm.candidates, "crosspipe-ud": to_ms(makespan)}
        if cp.polish is not None:
            pm.info["polish"] = cp.polish  # the polish's report, whichever plan wins
        if to_ms(makespan) >= pm.predicted_makespan_ms:
            pm.candidates = candidates
            pm.plan_ms += (time.perf_counter() - t0) * 1e3
            return pm
        try:
            if validate:
                validate_plan(ops, S, N, inflight_limit=caps, torch_dry_run=validate == "torch")
        except PlanValidationError as e:  # keep PipeMorph's (validated) plan
            pm.notes.append(f"CrossPipe's plan was faster but failed validation: {e}")
            return pm
        result = make_result(
            ops, ops_checked=True, schedule="auto", source="crosspipe-ud", predicted_makespan_ms=to_ms(makespan),
            plan_ms=0.0, stage_to_rank=range(S), profile=profile, inflight_limit=caps, candidates=candidates,
            notes=[n for n in pm.notes if not n.startswith("Alg.2 has no room")], info=dict(pm.info),
        )
    result.plan_ms = pm.plan_ms + (time.perf_counter() - t0) * 1e3
    return result


def check_memory_limit(memory_limit: float | None, stage_memory_limit: int | None = None) -> None:
    """The one check of the memory limits: K per rank (a number >= 1, in activations of a rank's whole
    model part) and per stage (an int >= 1); None: no limit."""
    limits = memory_limit if isinstance(memory_limit, (list, tuple)) else [memory_limit]
    for k in limits:
        if k is not None and (isinstance(k, bool) or not isinstance(k, (int, float)) or not math.isfinite(k) or k < 1):
            raise ValueError(f"memory_limit must be >= 1 activation (or one such per rank), got {memory_limit!r}")
    if stage_memory_limit is not None and (isinstance(stage_memory_limit, bool)
                                           or not isinstance(stage_memory_limit, int) or stage_memory_limit < 1):
        raise ValueError(f"stage_memory_limit must be an int >= 1 activation, got {stage_memory_limit!r}")


def one_stage_limit(memory_limit: float | None, stage_memory_limit: int | None) -> int | list[int] | None:
    """One stage per rank: the per-rank and the per-stage limit are the same thing; the tighter wins
    (the per-rank K must then be a whole number of activations; one K per rank: a per-stage list)."""
    per_rank = isinstance(memory_limit, (list, tuple))
    for k in (memory_limit if per_rank else [memory_limit]):
        if k is not None and k != int(k):
            raise ValueError(f"memory_limit {k:g}: with one stage per rank it must be a whole number "
                             f"of activations")
    if per_rank:
        return [int(k) if stage_memory_limit is None else min(int(k), stage_memory_limit) for k in memory_limit]
    limits = [int(v) for v in (memory_limit, stage_memory_limit) if v is not None]
    return min(limits) if limits else None


def plan_by_name(
    profile: PipelineProfile,
    name: str,
    *,
    virtual_stages: int = 1,
    placement: str | None = None,
    memory_limit: float | None = None,
    stage_memory_limit: int | None = None,
    time_limit_s: float = 60.0,
    stage_times_ms: tuple | None = None,
    full_backward: bool = True,
    polish_s: float | None = None,
    **pipemorph: Any,
) -> PlanResult:
    """The one by-name dispatch: plan ``name`` (any of ``SCHEDULE_NAMES``) for the rank-level ``profile``.

    * ``virtual_stages`` V ≥ 2: R = ``profile.num_stages`` ranks × V stages each, placed ``placement``
      ("loop", the default, or "v"), by :func:`~titan_ext.plan.virtual.plan_virtual` (``name`` one of
      ``VIRTUAL_SCHEDULES``; ``stage_times_ms``, ``full_backward`` go there);
    * ``auto`` → :func:`plan_auto`; ``pipemorph`` / ``zb`` / ``zb-h1`` →
      :func:`~titan_ext.plan.pipemorph.plan_pipemorph` (``pipemorph`` keywords: ``mode``,
      ``slack_floor``, ``validate``, ``backward``, ``candidates``, ``cap_inflight``);
    * ``crosspipe-ud`` / ``-udsub`` / ``-wave`` → CrossPipe's greedy; ``optimal`` → the CP-SAT optimum
      within ``time_limit_s`` (needs ortools);
    * ``polish_s`` (``auto``, ``crosspipe-ud``, ``crosspipe-udsub`` only; None: off): the CrossPipe plan
      is polished by CP-SAT and a longer search within that many seconds
      (:func:`~titan_ext.plan.polish.polish_crosspipe`; never slower, validated; skipped without ortools
      or above ``POLISH_MAX_OPS`` operations — the result's ``info["polish"]`` says which);
    * torch's built-in names (``BUILTIN_SCHEDULES``) → torch's own plan.

    ``memory_limit`` K: at most K activations of a rank's whole model part held on any rank (a chunk of a
    rank with V stages counts 1/V: crosspipe-wave's half chunks, virtual stages); ``stage_memory_limit``:
    at most that many in-flight activations on any one stage. With one stage per rank both are the
    per-stage in-flight limit and the tighter wins. Raises ValueError (bad input, no plan fits) or
    ImportError (``optimal`` without ortools).
    """
    profile_arg(profile)
    if not isinstance(name, str):
        raise ArgumentTypeError(f"name must be a schedule name ({', '.join(SCHEDULE_NAMES)}), got {name!r}")
    int_arg(virtual_stages, "virtual_stages", 1)
    real_arg(time_limit_s, "time_limit_s", positive=True)
    real_arg(polish_s, "polish_s", positive=True, optional=True)
    bool_arg(full_backward, "full_backward")
    if stage_times_ms is not None and virtual_stages == 1:
        raise ValueError("stage_times_ms applies to virtual_stages >= 2 (one stage per rank: the profile's times)")
    check_memory_limit(memory_limit, stage_memory_limit)
    if polish_s is not None and (name not in POLISH_SCHEDULES or virtual_stages != 1 or placement is not None):
        raise ValueError(f"polish_s applies to {', '.join(POLISH_SCHEDULES)} with one stage per rank, not {name!r}")
    if virtual_stages != 1 or placement is not None:
        return _plan_virtual(profile, name, virtual_stages, placement, memory_limit, stage_memory_limit,
                             stage_times_ms, full_backward, pipemorph)
    memory_limit = one_stage_limit(memory_limit, stage_memory_limit)
    if name == "auto":
        return plan_auto(profile, memory_limit=memory_limit, polish_s=polish_s, **pipemorph)
    if name in SCHEDULES:
        return plan_pipemorph(profile, schedule=name, memory_limit=memory_limit, **pipemorph)
    _split_only(name, pipemorph)
    if name in CROSSPIPE_SCHEDULES:
        return _plan_crosspipe(profile, name, memory_limit, time_limit_s, polish_s)
    if name in BUILTIN_SCHEDULES:
        return _plan_builtin(profile, name, memory_limit)
    raise ValueError(f"schedule must be one of {', '.join(SCHEDULE_NAMES)}, got {name!r}")


def _split_only(name: str, options: dict) -> None:
    """Planners that plan one thing only: no PipeMorph options besides a split backward."""
    backward = options.pop("backward", "split")
    options.pop("validate", None)  # these planners always validate (or are torch's own)
    for unused in ("mode", "slack_floor"):
        options.pop(unused, None)
    if options:
        raise ValueError(f"{name}: unexpected option(s) {', '.join(sorted(options))}")
    if backward != "split" and name not in BUILTIN_SCHEDULES:
        raise ValueError(f"backward {backward}: {name} plans split backwards only")


def _plan_virtual(profile, name, V, placement, memory_limit, stage_memory_limit, stage_times_ms, full_backward,
                  options) -> PlanResult:
    from .virtual import plan_virtual

    if V < 2:
        raise ValueError("placement needs virtual_stages >= 2 (one stage per rank: leave both out)")
    if options.get("backward", "split") != "split":
        raise ValueError(f"backward {options['backward']}: multi-stage plans split backwards only")
    validate = options.get("validate", True)
    return plan_virtual(profile, V, placement or "loop", schedule=name, stage_times_ms=stage_times_ms,
                        memory_limit=memory_limit, stage_memory_limit=stage_memory_limit, validate=bool(validate),
                        full_backward=full_backward)


def _plan_crosspipe(profile: PipelineProfile, name: str, memory_limit: int | None, time_limit_s: float,
                    polish_s: float | None = None) -> PlanResult:
    """CrossPipe's greedy (ud, udsub, wave: CrossPipe §4.2) or the CP-SAT optimum (§4.1)."""
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be a number of seconds > 0, got {time_limit_s!r}")
    if name == "optimal":
        return _plan_optimal(profile, memory_limit, time_limit_s)
    variant = name.split("-", 1)[1]
    sim_profile, limit = profile, memory_limit
    if variant == "wave":
        sim_profile = wave_profile(profile)
        limit = None if memory_limit is None else 2 * memory_limit
    plan = plan_crosspipe(sim_profile, variant, memory_limit=limit)
    if polish_s is not None:
        plan = polish_crosspipe(sim_profile, plan, budget_s=polish_s)
    info = {"n_sub": plan.n_sub, "steady": plan.steady, "reserve": plan.reserve, "lookahead": plan.lookahead,
            "caps": plan.caps, "local_search_improved": plan.improved, "crosspipe_peak_memory": plan.peak_memory}
    if plan.polish is not None:
        info["polish"] = plan.polish
    return make_result(as_ops(dict(sorted(plan.orders.items()))), ops_checked=True, schedule=name, source=f"{name}:{plan.caps}",
                       predicted_makespan_ms=plan.makespan_ms, plan_ms=plan.plan_ms,
                       stage_to_rank=plan.stage_to_rank, profile=sim_profile, info=info,
                       candidates={_member_name(c): None if math.isinf(c.makespan_ms) else c.makespan_ms
                                   for c in plan.candidates})  # None: no schedule under that member's caps


def _member_name(c) -> str:
    return f"n_sub={c.n_sub},{c.steady},reserve={c.reserve},lookahead={c.lookahead},caps={c.caps}"


def _plan_optimal(profile: PipelineProfile, memory_limit: int | None, time_limit_s: float) -> PlanResult:
    res = solve_optimal(profile, memory_limit=memory_limit, time_limit_s=time_limit_s)
    if res.orders is None:
        raise ValueError(f"the solver found no schedule within {time_limit_s} s (status {res.status})")
    info = {"solver_status": res.status, "proven_optimal": res.proven, "solver_makespan_ms": res.makespan_ms,
            "bound_ms": res.bound_ms, "time_unit_ms": res.time_unit_ms}
    return make_result(as_ops(dict(sorted(res.orders.items()))), ops_checked=True, schedule="optimal", predicted_makespan_ms=res.makespan_ms,
                       plan_ms=res.solve_s * 1e3, profile=profile, info=info)


def _plan_builtin(profile: PipelineProfile, name: str, memory_limit: int | None) -> PlanResult:
    from .builtin import plan_builtin

    result = plan_builtin(name, profile)
    worst = max(result.peak_memory_per_rank.values())
    if memory_limit is not None and worst > memory_limit:
        raise ValueError(f"torch's {result.schedule} holds {worst:g} activations on a rank, above the "
                         f"memory limit {memory_limit}")
    return result
