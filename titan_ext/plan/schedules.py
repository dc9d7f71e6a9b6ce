"""Plan by name, above every planner: PipeMorph's schedules and ``auto``, the fastest of PipeMorph and
CrossPipe's greedy for the profile (issue 12). Every name returns a :class:`PlanResult`.

``auto`` exists because the two planners win in different regimes: PipeMorph (§4.2) absorbs a slow
link with slackness, which Alg.2 clips at N − 2S, so with few microbatches (N ≤ 2S) it has no room;
CrossPipe's greedy (§4.2.2) reorders operations instead. Both plans are timed by the one simulator.

Also the by-name dispatch of CrossPipe's own schedules and the optimal solver (the CLI's and
scripts' entry). This module sits above ``crosspipe``, ``optimal`` and ``pipemorph`` in plan/'s
import order and nothing in plan/ imports it.
"""

from __future__ import annotations

import time

from .crosspipe import plan_crosspipe, wave_profile
from .ir import as_ops, gc_paused, torch_schedules
from .optimal import solve_optimal
from .pipemorph import SCHEDULES, memory_caps, plan_pipemorph
from .profile import PipelineProfile
from .result import PlanResult, warmup_counts_of
from .simulate import peak_inflight, replay_makespan_ns
from .timing import to_ms
from .validate import PlanValidationError, validate_plan

__all__ = ["AUTO_SCHEDULES", "CROSSPIPE_SCHEDULES", "plan_auto", "plan_by_name", "plan_crosspipe_by_name"]

AUTO_SCHEDULES = ("auto",) + SCHEDULES

CROSSPIPE_SCHEDULES = ("crosspipe-ud", "crosspipe-udsub", "crosspipe-wave", "optimal")


def plan_auto(
    profile: PipelineProfile,
    *,
    memory_limit: int | None = None,
    mode: str = "auto",
    slack_floor: int = 2,
    validate: bool | str = True,
    backward: str = "split",
) -> PlanResult:
    """The faster of ``plan_pipemorph`` (its candidates included) and CrossPipe's CrossUD greedy, both
    held to the same per-stage in-flight limit; ties go to PipeMorph. CrossPipe plans split backwards
    only, so ``backward="full"`` is PipeMorph's plan."""
    pm = plan_pipemorph(profile, mode=mode, slack_floor=slack_floor, memory_limit=memory_limit,
                        validate=validate, backward=backward)
    if backward != "split":
        return pm
    torch_schedules()
    t0 = time.perf_counter()
    caps = memory_caps(profile, memory_limit)
    S, N = profile.num_stages, profile.num_microbatches
    with gc_paused():
        cp = plan_crosspipe(profile, "ud", memory_limit=caps, validate=False)
        ops = as_ops(cp.actions)
        makespan = replay_makespan_ns(ops, profile)
        candidates = {**pm.candidates, "crosspipe-ud": to_ms(makespan)}
        if to_ms(makespan) >= pm.predicted_makespan_ms:
            pm.candidates, pm.plan_ms = candidates, pm.plan_ms + (time.perf_counter() - t0) * 1e3
            return pm
        try:
            if validate:
                validate_plan(ops, S, N, inflight_limit=caps, torch_dry_run=validate == "torch")
        except PlanValidationError as e:  # keep PipeMorph's (validated) plan
            pm.notes.append(f"CrossPipe's plan was faster but failed validation: {e}")
            return pm
    return PlanResult(
        actions=cp.actions,
        ops=ops,
        schedule="auto:crosspipe-ud",
        warmup_counts=warmup_counts_of(ops),
        predicted_makespan_ms=to_ms(makespan),
        peak_inflight=peak_inflight(ops),
        plan_ms=pm.plan_ms + (time.perf_counter() - t0) * 1e3,
        stage_to_rank={s: s for s in range(S)},
        inflight_limit=caps,
        notes=[n for n in pm.notes if not n.startswith("Alg.2 has no room")],
        candidates=candidates,
    )


def plan_by_name(profile: PipelineProfile, name: str, **kwargs) -> PlanResult:
    """``auto`` → :func:`plan_auto`; ``pipemorph`` / ``zb`` / ``zb-h1`` → :func:`plan_pipemorph`
    (keyword arguments are passed on). CrossPipe's own names: :func:`plan_crosspipe_by_name`."""
    if name == "auto":
        return plan_auto(profile, **kwargs)
    if name in SCHEDULES:
        return plan_pipemorph(profile, schedule=name, **kwargs)
    raise ValueError(f"schedule must be one of {AUTO_SCHEDULES}, got {name!r}")


def _optimal(profile, memory_limit: int | None, time_limit_s: float) -> tuple:
    res = solve_optimal(profile, memory_limit=memory_limit, time_limit_s=time_limit_s)
    if res.actions is None:
        raise ValueError(f"the solver found no schedule within {time_limit_s} s (status {res.status})")
    info = {"solver_status": res.status, "proven_optimal": res.proven, "solver_makespan_ms": res.makespan_ms,
            "bound_ms": res.bound_ms, "plan_ms": round(res.solve_s * 1e3, 3), "time_unit_ms": res.time_unit_ms}
    return res.actions, profile, tuple(range(profile.num_stages)), info


def plan_crosspipe_by_name(profile, name: str, memory_limit: int | None = None,
                           time_limit_s: float = 60.0) -> tuple:
    """Plan ``name`` (one of ``CROSSPIPE_SCHEDULES``) for a one-stage-per-rank ``profile``.

    Returns ``(actions, sim_profile, stage_to_rank, info)``: the validated torch-IR plan, the profile to
    simulate it with (the V-shape profile of :func:`~titan_ext.plan.crosspipe.wave_profile` for
    crosspipe-wave), its stage→rank map and a JSON-able dict.  ``memory_limit`` K: in-flight activations
    per stage, in units of one stage's activation (for crosspipe-wave: K per rank, i.e. 2K half-size
    chunk activations).
    """
    if name not in CROSSPIPE_SCHEDULES:
        raise ValueError(f"schedule must be one of {CROSSPIPE_SCHEDULES}, got {name!r}")
    if name == "optimal":
        return _optimal(profile, memory_limit, time_limit_s)
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
            "crosspipe_peak_memory": plan.peak_memory}
    return plan.actions, sim_profile, plan.stage_to_rank, info
