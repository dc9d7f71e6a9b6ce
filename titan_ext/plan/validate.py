"""Plan validator: a plan that fails here is never returned by a planner nor deployed by the runtime.

Checks, in order (each failure raises ``PlanValidationError`` with the reason):
1. completeness — every (stage, microbatch) has exactly one F and either one I and one W, or one full B;
   every stage lives on exactly one rank; no unknown stage or microbatch;
2. progress — the plan runs to completion under the dependency rule (``deps.producers``: no
   cross-rank deadlock); when it does not, a consumer placed before its producer on one rank (local
   order: I or B after its F, W after its I) is named as such;
3. memory — per stage, in-flight activations (F done − I/B done; ``release="W"``: − W/B done,
   ``profile.RELEASES``) never exceed ``inflight_limit``;
4. torch (opt-in, ``torch_dry_run=True``) — torch's own checker ``_validate_schedule``, SEND/RECV
   lowering ``_add_send_recv`` (the pass
   ``_PipelineScheduleRuntime._prepare_schedule_with_comms`` runs; on torch >= 2.15 followed by
   ``_add_wait_send`` and ``_validate_send_waits``) followed by torch's dry run
   ``_simulate_comms_compute`` completes (on 2.15 it also orders each WAIT_SEND after the peer's
   receive). (torch's dry run does not understand the FSDP UNSHARD/RESHARD/REDUCE_GRAD/
   WAIT_REDUCE_GRAD actions of the other passes, which do not affect ordering.)
"""

from __future__ import annotations

import contextlib
import io
from typing import Any, Mapping, Sequence

from ..args import bool_arg, counts_arg, int_arg, plan_arg
from .complete import PlanValidationError, check_complete
from .deps import SAME_STAGE, done_key, producers, table
from .profile import released_by
from .ir import add_send_waits, as_ops, fsdp_action_types, gc_paused, stage_to_rank_map, to_torch_plan, torch_schedules
from .simulate import peak_inflight


def compiled_core():
    """``titan_ext.plan._pipemorph_c`` (from ``_pipemorph.c``: the generator and checks 1–3 compiled,
    checked against the Python code by tests/plan/test_plan_pipemorph_c.py), or None when it is not built."""
    try:
        from . import _pipemorph_c
    except ImportError:
        return None
    return _pipemorph_c


_CORE = compiled_core()


def validate_plan(
    plan: Mapping[int, Any],
    num_stages: int,
    num_microbatches: int,
    *,
    inflight_limit: Sequence[int] | int | None = None,
    torch_dry_run: bool = False,
    release: str = "I",
) -> dict[int, int]:
    """Raise ``PlanValidationError`` unless ``plan`` (rank → compute-only actions) is valid.
    ``release``: the memory rule of check 3 ("I" or "W", ``profile.RELEASES``).

    Checks 1–3 are ours (the hot path: planners, CLI, run-time re-planning); ``torch_dry_run=True``
    adds check 4, torch's lowering + dry run (``validate="torch"``, ``titan-ext plan --strict``).
    Returns the per-stage peak in-flight activations (``simulate.peak_inflight``).

    Checks 1–3 run compiled where ``_pipemorph_c`` is built (it reads plans of plain ``(stage, kind,
    microbatch)`` tuples directly); a plan it does not accept goes through the Python checks, which name
    the reason (the two agree: tests/plan/test_plan_pipemorph_c.py).
    """
    plan_arg(plan)
    int_arg(num_stages, "num_stages", 1)
    int_arg(num_microbatches, "num_microbatches", 1)
    released_by(release)
    bool_arg(torch_dry_run, "torch_dry_run")
    if inflight_limit is not None:
        if isinstance(inflight_limit, (str, bytes)) or not hasattr(inflight_limit, "__iter__"):
            int_arg(inflight_limit, "inflight_limit", 1)
        else:
            counts_arg(list(inflight_limit), "inflight_limit", num_stages, minimum=1)
    if _CORE is not None and isinstance(plan, dict):
        peaks = _CORE.check(table(num_stages).spec(), plan, num_stages, num_microbatches, inflight_limit,
                            release == "W")
        if peaks is not None:
            if torch_dry_run:  # valid for checks 1-3; torch's own checks follow
                with gc_paused():
                    _torch_dry_run(plan, stage_to_rank_map(plan), num_stages, num_microbatches)
            return dict(enumerate(peaks))
    try:
        ops = as_ops(plan)
    except ValueError as e:
        raise PlanValidationError(str(e)) from e
    return _check_python(ops, num_stages, num_microbatches, inflight_limit, torch_dry_run, release)


def _check_python(ops: dict, num_stages: int, num_microbatches: int, inflight_limit,
                  torch_dry_run: bool, release: str = "I") -> dict[int, int]:
    """Checks 1–4 in Python: the reference, and the path that names what is wrong. Returns the peaks."""
    try:
        placement = stage_to_rank_map(ops)
    except ValueError as e:
        raise PlanValidationError(str(e)) from e
    if set(placement) != set(range(num_stages)):
        raise PlanValidationError(f"plan covers stages {sorted(placement)}, expected 0..{num_stages - 1}")

    check_complete(ops, num_stages, num_microbatches)

    stuck = _first_deadlock(ops, num_stages)
    if stuck:  # a consumer before its producer on one rank blocks that rank: name it precisely
        _check_local_order(ops)
        raise PlanValidationError(f"plan deadlocks: each rank's next action waits forever: {stuck}")

    peaks = peak_inflight(ops, release)
    if inflight_limit is not None:
        for s, peak in peaks.items():
            cap = inflight_limit if isinstance(inflight_limit, int) else inflight_limit[s]
            if peak > cap:
                raise PlanValidationError(
                    f"stage {s} holds {peak} in-flight activations, above its limit of {cap}"
                )

    if torch_dry_run:
        with gc_paused():
            _torch_dry_run(ops, placement, num_stages, num_microbatches)
    return peaks


def _check_local_order(ops: Mapping[int, list]) -> None:
    """On its rank, I (or B) of a microbatch comes after its F, and W after its I."""
    for rank, rank_ops in ops.items():
        seen: set[tuple[int, str, int]] = set()
        for s, k, m in rank_ops:
            need = SAME_STAGE.get(k)
            if need and (s, need, m) not in seen:
                raise PlanValidationError(f"rank {rank}: {s}{k}{m} comes before {s}{need}{m}")
            seen.add((s, k, m))


def _first_deadlock(ops: Mapping[int, list], num_stages: int) -> dict | None:
    """Run every rank's list in order with dependencies only (``deps.producers``, no times); None if
    all complete, else each blocked rank's next action."""
    done: set[tuple[int, str, int]] = set()
    pos = {r: 0 for r in ops}
    remaining = sum(len(v) for v in ops.values())
    while remaining:
        progressed = False
        for r, rank_ops in ops.items():
            p = pos[r]
            while p < len(rank_ops):
                op = rank_ops[p]
                needs = producers(op, num_stages)
                if needs and (needs[0] not in done or (len(needs) == 2 and needs[1] not in done)):
                    break
                done.add(done_key(op))
                p += 1
            if p != pos[r]:
                remaining -= p - pos[r]
                pos[r] = p
                progressed = True
        if not progressed:
            return {r: ops[r][pos[r]] for r in ops if pos[r] < len(ops[r])}
    return None


def torch_dry_run_lowered(lowered: Mapping[int, list[Any]], stage_to_rank: Any, num_stages: int) -> None:
    """torch's dry run ``_simulate_comms_compute`` on an already lowered plan (rank → actions with
    SEND/RECV, e.g. what ``_prepare_schedule_with_comms``'s passes produce — the exact action lists a
    runtime will execute). The FSDP UNSHARD/RESHARD/REDUCE_GRAD/WAIT_REDUCE_GRAD actions, which the dry run does not
    understand and which do not affect ordering, are left out. Raises ``PlanValidationError``."""
    sched = torch_schedules()
    skip = fsdp_action_types()
    plan = {r: [a for a in acts if a is not None and a.computation_type not in skip] for r, acts in lowered.items()}
    lookup = stage_to_rank if callable(stage_to_rank) else stage_to_rank.__getitem__
    buf = io.StringIO()
    try:
        with gc_paused(), contextlib.redirect_stdout(buf):
            if hasattr(sched, "_validate_send_waits"):  # torch >= 2.15: one ordered wait per send
                sched._validate_send_waits(plan)
            sched._simulate_comms_compute(plan, stage_to_rank=lookup, num_stages=num_stages)
    except Exception as e:  # torch raises ValueError / AssertionError / RuntimeError
        raise PlanValidationError(f"torch's dry run rejects the lowered plan: {e}") from e


def _torch_dry_run(ops, placement: dict[int, int], num_stages: int, num_microbatches: int) -> None:
    sched = torch_schedules()
    actions = to_torch_plan(ops)
    stage_to_rank = placement.__getitem__
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            sched._validate_schedule(actions, len(actions), num_stages, num_microbatches)
            lowered = add_send_waits(sched._add_send_recv(actions, stage_to_rank=stage_to_rank,
                                                          num_stages=num_stages))
            sched._simulate_comms_compute(lowered, stage_to_rank=stage_to_rank, num_stages=num_stages)
    except Exception as e:  # torch raises ValueError / AssertionError / RuntimeError
        raise PlanValidationError(f"torch's lowering / dry run rejects the plan: {e}") from e
