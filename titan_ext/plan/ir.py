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
from functools import lru_cache
from typing import Any, Iterable, Mapping

COMPUTE_KINDS = ("F", "I", "W", "B")

# (stage, kind, microbatch) — the planners' internal action.
Op = tuple[int, str, int]


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


def to_torch_plan(plan: Mapping[int, Iterable[Op]]) -> dict[int, list[Any]]:
    """Internal plan (rank → ops) → torch IR (rank → list[_Action])."""
    if not isinstance(plan, Mapping):
        raise ValueError(f"plan must be a mapping rank → list of ops, got {type(plan).__name__}")
    sched = torch_schedules()
    kinds = {k: sched._ComputationType.from_str(k) for k in COMPUTE_KINDS}
    action = sched._Action
    return {rank: [action(s, kinds[k], m) for s, k, m in ops] for rank, ops in plan.items()}


def as_ops(plan: Mapping[int, Iterable[Any]]) -> dict[int, list[Op]]:
    """Normalise a plan given as torch ``_Action`` lists or as tuples to ``(stage, kind, mb)`` tuples.

    ``None`` entries (torch's idle slots) are dropped. Any non-compute action is rejected: plans here
    are compute-only and torch's lowering adds the communication.
    """
    if not isinstance(plan, Mapping):
        raise ValueError(f"plan must be a mapping rank → list of actions, got {type(plan).__name__}")
    out: dict[int, list[Op]] = {}
    for rank, actions in plan.items():
        if all(type(a) is tuple and len(a) == 3 and a[1] in COMPUTE_KINDS for a in actions):
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
            stage, kind, mb = a[0], a[1], a[2]
            kind = getattr(kind, "value", kind)
            if kind not in COMPUTE_KINDS:
                raise ValueError(
                    f"rank {rank}: action {stage}{kind}{mb} is not a compute action "
                    f"(plans are compute-only: F, I, W or B)"
                )
            if mb is None:
                raise ValueError(f"rank {rank}: action {stage}{kind} has no microbatch index")
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
