"""torch's own built-in schedules as compute-only plans, taken from torch itself (not re-implemented).

torch builds ``pipeline_order`` (rank → compute actions) in each schedule's constructor from the
stages' group size/rank. We construct the schedule class with lightweight stand-in stage objects that
carry only those attributes — no module, no process group — and read ``pipeline_order`` back.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from ..args import ArgumentTypeError, int_arg
from .profile import profile_arg
from .ir import as_ops, torch_schedules
from .placement import stage_profile
from .profile import PipelineProfile
from .result import PlanResult, make_result
from .simulate import simulate

# name → (torch class name, model chunks per rank)
BUILTINS: dict[str, tuple[str, int]] = {
    "1F1B": ("Schedule1F1B", 1),
    "GPipe": ("ScheduleGPipe", 1),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", 2),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", 2),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", 2),
    "DualPipeV": ("ScheduleDualPipeV", 2),
}


def _canonical(name: str) -> str:
    if not isinstance(name, str):
        raise ArgumentTypeError(f"name must be the name of a built-in schedule ({', '.join(BUILTINS)}), "
                                f"got {name!r}")
    for key in BUILTINS:
        if key.lower() == name.lower():
            return key
    raise ValueError(f"unknown built-in schedule {name!r}; choose from {', '.join(BUILTINS)}")


def builtin_plan(name: str, num_ranks: int, num_microbatches: int) -> tuple[dict[int, list[Any]], dict[int, int]]:
    """torch's compute-only plan for schedule ``name`` on ``num_ranks`` ranks, and its stage → rank map.

    Multi-chunk schedules (Interleaved*, ZBV, DualPipeV) place 2 stages on each rank, so the plan has
    ``2 * num_ranks`` stages. Only compute actions are returned (torch's REDUCE_GRAD etc. are dropped;
    DualPipeV's overlapped F+B pairs are split into their two sub-actions in order).
    """
    key = _canonical(name)
    int_arg(num_ranks, "num_ranks", 1)
    int_arg(num_microbatches, "num_microbatches", 1)
    cls_name, chunks = BUILTINS[key]
    sched = torch_schedules()
    cls = getattr(sched, cls_name)
    num_stages = num_ranks * chunks
    style = "v" if key in ("ZBVZeroBubble", "DualPipeV") else "loop"
    stage_to_rank = sched.generate_stage_to_rank_mapping(num_ranks, num_stages, style=style)
    plan: dict[int, list[Any]] = {}
    for rank in range(num_ranks):
        local = [s for s in range(num_stages) if stage_to_rank[s] == rank]
        stages = [
            SimpleNamespace(
                stage_index=s,
                num_stages=num_stages,
                group_size=num_ranks,
                group_rank=rank,
                is_first=s == 0,
                is_last=s == num_stages - 1,
                submod=None,
                stage_index_to_group_rank=stage_to_rank,
            )
            for s in local
        ]
        try:
            schedule = cls(stages[0] if chunks == 1 else stages, num_microbatches)
        except Exception as e:  # torch's own argument checks (e.g. N < S for 1F1B)
            raise ValueError(f"torch's {cls_name} rejects {num_ranks} ranks × {num_microbatches} microbatches: {e}") from e
        order = schedule.pipeline_order[rank]
        actions = []
        for a in order:
            if a is None:
                continue
            subs = a.sub_actions if a.sub_actions is not None else (a,)
            actions.extend(x for x in subs if x.is_compute_op)
        plan[rank] = actions
    if key == "1F1B":
        _repair_1f1b_last_rank(plan, num_ranks, num_microbatches)
    as_ops(plan)  # fail early on anything unexpected
    return plan, dict(stage_to_rank)


def plan_builtin(name: str, profile: PipelineProfile) -> PlanResult:
    """torch's built-in schedule ``name`` for a rank-level ``profile`` (one entry per rank; multi-chunk
    schedules split a rank's times over its stages, see ``simulate``) as a :class:`PlanResult`, its
    makespan and peak in-flight activations from the reference simulator under the profile."""
    profile_arg(profile)
    torch_schedules()
    t0 = time.perf_counter()
    actions, stage_to_rank = builtin_plan(name, profile.num_stages, profile.num_microbatches)
    ops = as_ops(actions)
    s2r = tuple(stage_to_rank[s] for s in range(len(stage_to_rank)))
    timeline = simulate(ops, profile, stage_to_rank=stage_to_rank)
    result = make_result(ops, ops_checked=True, schedule=_canonical(name), predicted_makespan_ms=timeline.makespan_ms,
                         plan_ms=0.0, stage_to_rank=s2r, profile=stage_profile(profile, s2r))
    result.plan_ms = (time.perf_counter() - t0) * 1e3
    return result


def _repair_1f1b_last_rank(plan: dict[int, list[Any]], num_ranks: int, num_microbatches: int) -> None:
    """torch 2.13's ``Schedule1F1B._get_pipeline_order`` numbers the last rank's forwards 1..N instead
    of 0..N−1 (its warm-up count there is 0, and the steady loop pre-increments the index). torch's
    runtime (``_step_microbatches``) runs F0 first on that rank, so the IR is off by one only on paper.
    We shift exactly that pattern back and leave any other plan untouched."""
    last = num_ranks - 1
    sched = torch_schedules()
    fwd = [a.microbatch_index for a in plan[last] if a.computation_type == sched.F]
    if fwd == list(range(1, num_microbatches + 1)):
        plan[last] = [
            sched._Action(a.stage_index, a.computation_type, a.microbatch_index - 1)
            if a.computation_type == sched.F
            else a
            for a in plan[last]
        ]
