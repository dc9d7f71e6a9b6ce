"""The one schedule IR: torch's ``_Action`` (DESIGN.md "One schedule IR").

Planners work on plain ``(stage, kind, microbatch)`` tuples, with ``kind`` one of ``"F"``, ``"I"``
(backward-input, "B" in the papers), ``"W"`` (backward-weight) or ``"B"`` (full backward, 1F1B-style).
This module is the only place where plan/ meets torch: it loads
``torch.distributed.pipelining.schedules`` lazily, on first use, so ``import titan_ext.plan`` stays
torch-free and fast. Nothing here creates a process group.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import math
import numbers
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable, Mapping

COMPUTE_KINDS = ("F", "I", "W", "B")
"""The one op-kind alphabet: forward, backward-input, backward-weight, full backward (torch's
``_ComputationType`` names). Every other list of kinds is derived from it (``deps.KINDS``, the runtime's
profiler and estimator, the exporters' legend order, TorchTitan's monitor); tests/package/test_one_definition.py
checks that no module spells it again."""

# (stage, kind, microbatch) — the planners' internal action.
Op = tuple[int, str, int]


@dataclass
class TimedAction:
    """The one timed-action record: an op — ``stage``, ``kind`` (:data:`COMPUTE_KINDS`), ``microbatch`` —
    and when it ran, from ``start`` to ``end`` on one clock. The clock and its unit are the subclass's,
    which names them and keeps its own constructor: ``plan.simulate.ActionEvent`` (+ ``rank``; ms from
    the plan's start: ``start_ms`` / ``end_ms``), the runtime profiler's
    ``runtime.measure.profiler.ActionRecord`` (+ ``recv_wait_ms``; seconds on the device layer's host
    clock, filled in by its timer) and TorchTitan's monitor's ``titan.monitor.Action`` (integer ns:
    ``start_ns`` / ``end_ns``)."""

    stage: int
    kind: str
    microbatch: int
    start: float = math.nan
    end: float = math.nan

    @property
    def op(self) -> Op:
        """The plan IR's ``(stage, kind, microbatch)``."""
        return (self.stage, self.kind, self.microbatch)


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic garbage collector while a planner allocates its ~3NS small tuples: plans hold
    no reference cycles, and generation-0 collections otherwise dominate large plans (S=64, N=512)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@lru_cache(maxsize=1)
def torch_schedules() -> Any:
    """torch.distributed.pipelining.schedules, imported on first use."""
    return importlib.import_module("torch.distributed.pipelining.schedules")


#: FSDP actions torch's dry run ``_simulate_comms_compute`` does not model (they do not affect ordering);
#: WAIT_REDUCE_GRAD exists from torch 2.15 on
FSDP_ACTION_NAMES = ("UNSHARD", "RESHARD", "REDUCE_GRAD", "WAIT_REDUCE_GRAD")


def fsdp_action_types() -> set[Any]:
    """The FSDP ``_ComputationType`` members this torch has (see :data:`FSDP_ACTION_NAMES`)."""
    ct = torch_schedules()._ComputationType
    return {getattr(ct, name) for name in FSDP_ACTION_NAMES if hasattr(ct, name)}


def add_send_waits(lowered: dict[int, list[Any]]) -> dict[int, list[Any]]:
    """torch >= 2.15's pass ``_add_wait_send`` (one WAIT_SEND_F/B per send: a forward send's wait after
    its local backward, the others at the end) followed by torch's check ``_validate_send_waits`` --
    what ``_PipelineScheduleRuntime._prepare_schedule_with_comms`` runs after ``_add_send_recv``.
    Older torch has no send waits (sends are waited at the end of the step): ``lowered`` unchanged."""
    sched = torch_schedules()
    if not hasattr(sched, "_add_wait_send"):
        return lowered
    lowered = sched._add_wait_send(lowered)
    sched._validate_send_waits(lowered)
    return lowered


def to_torch_plan(plan: Mapping[int, Iterable[Op]]) -> dict[int, list[Any]]:
    """Internal plan (rank → ops) → torch IR (rank → list[_Action])."""
    from ..args import plan_arg

    plan_arg(plan)
    sched = torch_schedules()
    kinds = {k: sched._ComputationType.from_str(k) for k in COMPUTE_KINDS}
    action = sched._Action
    try:
        out = {rank: [action(s, kinds[k], m) for s, k, m in ops] for rank, ops in plan.items()}
        if all(type(s) is int and s >= 0 and type(m) is int and m >= 0 for ops in plan.values() for s, _, m in ops):
            return out
        raise ValueError("an op's stage or microbatch is not an integer >= 0")  # named below
    except (KeyError, TypeError, ValueError):  # name the op (the fast path above checks nothing)
        for rank, ops in plan.items():
            for op in ops:
                if not (type(op) is tuple and len(op) == 3 and op[1] in COMPUTE_KINDS
                        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (op[0], op[2]))):
                    raise ValueError(f"plan[{rank!r}]: {op!r} is not an op (stage, kind, microbatch) with kind one "
                                     f"of {COMPUTE_KINDS} and stage, microbatch integers >= 0 (torch actions: "
                                     f"as_ops(plan) first)") from None
        raise


def as_ops(plan: Mapping[int, Iterable[Any]]) -> dict[int, list[Op]]:
    """Normalise a plan given as torch ``_Action`` lists or as tuples to ``(stage, kind, mb)`` tuples.

    ``None`` entries (torch's idle slots) are dropped. Any non-compute action is rejected: plans here
    are compute-only and torch's lowering adds the communication.
    """
    from ..args import plan_arg

    plan_arg(plan)
    out: dict[int, list[Op]] = {}
    for rank, actions in plan.items():
        if not ((isinstance(rank, numbers.Integral) and not isinstance(rank, bool) and rank >= 0)
                or (isinstance(rank, str) and rank.isascii() and rank.isdigit())):  # JSON keys are text
            raise ValueError(f"plan: rank {rank!r} is not an integer >= 0")
        if all(type(a) is tuple and len(a) == 3 and a[1] in COMPUTE_KINDS and type(a[0]) is int and a[0] >= 0
               and type(a[2]) is int and a[2] >= 0 for a in actions):
            out[int(rank)] = actions if isinstance(actions, list) else list(actions)  # already ours
            continue
        ops: list[Op] = []
        for a in actions:
            if a is None:
                continue
            if isinstance(a, str):
                a = torch_schedules()._Action.from_str(a)
                if a is None:
                    continue
            try:
                stage, kind, mb = a[0], a[1], a[2]
            except (TypeError, IndexError, KeyError):
                raise ValueError(f"plan[{rank!r}]: {a!r} is not an action (stage, kind, microbatch)") from None
            kind = getattr(kind, "value", kind)
            if kind not in COMPUTE_KINDS:
                raise ValueError(
                    f"rank {rank}: action {stage}{kind}{mb} is not a compute action "
                    f"(plans are compute-only: F, I, W or B)"
                )
            if mb is None:
                raise ValueError(f"rank {rank}: action {stage}{kind} has no microbatch index")
            for what, v in (("stage", stage), ("microbatch", mb)):
                if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                    raise ValueError(f"plan[{rank!r}]: action {stage}{kind}{mb}: its {what} must be an integer >= 0, "
                                     f"got {v!r}")
            ops.append((int(stage), str(kind), int(mb)))
        out[int(rank)] = ops
    return out


def stage_to_rank_map(plan: Mapping[int, Iterable[Op]]) -> dict[int, int]:
    """stage → rank, as the plan places them (each stage must live on exactly one rank)."""
    placement: dict[int, int] = {}
    for rank, ops in plan.items():
        for stage, kind, mb in ops:
            prev = placement.setdefault(stage, rank)
            if prev != rank:
                raise ValueError(f"stage {stage} appears on ranks {prev} and {rank}")
    return placement
