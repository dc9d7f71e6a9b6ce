"""Plan-by-name dispatch for the CrossPipe schedules and the optimal solver (the CLI's and scripts'
entry): above ``crosspipe`` and ``optimal`` in plan/'s import order, imported by nothing in plan/."""

from __future__ import annotations

from .crosspipe import plan_crosspipe, wave_profile
from .optimal import solve_optimal

__all__ = ["CROSSPIPE_SCHEDULES", "plan_crosspipe_by_name"]

CROSSPIPE_SCHEDULES = ("crosspipe-ud", "crosspipe-udsub", "crosspipe-wave", "optimal")


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
            "peak_memory_per_rank": plan.peak_memory}
    return plan.actions, sim_profile, plan.stage_to_rank, info
