"""Deployment of a compute-only plan: candidate → validate → lower (torch's passes) → agree → swap.

The runtime is handed the plan IR (``PlanResult.ops``: ``(stage, kind, microbatch)`` tuples per rank,
``titan_ext.plan.ir``) and lowers it the way torch's ``_PipelineScheduleRuntime`` does, as small pure
passes run in order by :func:`prepare_candidate`:

1. :func:`check_plan` — a plan is never trusted because a planner made it (PipeMorph §6, step ⑤):
   ``titan_ext.plan.validate_plan`` (completeness, per-rank order, in-flight memory limit, progress), and
   every rank runs only the stages it holds;
2. :func:`to_torch_actions` — the plan IR → torch's ``_Action`` lists: the runtime's one conversion (torch
   actions never come from the planner);
3. :func:`lower` — the passes ``_PipelineScheduleRuntime._prepare_schedule_with_comms`` runs, in the same
   order (``_validate_schedule`` → ``_add_unshard_reshard`` (FSDP only) → ``_add_reduce_grad`` →
   ``_add_send_recv``; on torch >= 2.15 also ``_add_wait_send`` → ``_validate_send_waits``, and
   ``_add_reduce_grad`` there pairs each REDUCE_GRAD with a WAIT_REDUCE_GRAD);
4. ``torch_dry_run_lowered`` — torch's simulator on the very lowered lists the executor will run.

All of it is pure (no process group, no schedule state), so it runs in the background planning thread
and in unit tests. Agreement (one hash exchange on the control plane) and the O(1) swap are the schedule's.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from torch.distributed.pipelining import schedules as _torch_schedules
from torch.distributed.pipelining.schedules import _Action

from titan_ext.plan import PlanResult, PlanValidationError, validate_plan
from titan_ext.plan import ir as _ir
from titan_ext.args import ArgumentTypeError, plan_arg
from titan_ext.plan.ir import Op, add_send_waits, as_ops
from titan_ext.plan.result import make_result, peak_inflight, warmup_counts_of  # the one definitions (per stage)
from titan_ext.plan.validate import torch_dry_run_lowered

from ..execute.memory import RELEASE
from ..measure.profiler import now

__all__ = ["Candidate", "DeployedPlan", "backward_of", "check_plan", "external_candidate", "external_plan", "lower",
           "plan_hash", "prepare_candidate", "to_torch_actions", "warmup_counts_of"]


def plan_hash(actions: Mapping[int, list[Any]]) -> int:
    """52-bit hash of a compute-only plan (exactly representable in a float64 profile vector)."""
    ops = as_ops(actions)
    text = ";".join(f"{r}:" + ",".join(f"{s}{k}{m}" for s, k, m in ops[r]) for r in sorted(ops))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 52) - 1)


def backward_of(actions: Mapping[int, list[Any]]) -> str:
    """``"full"`` when a compute-only plan runs full backwards (B) only, ``"split"`` when I and W only,
    ``"mixed"`` when both (``backward.mixed_backward``)."""
    kinds = {k for ops in as_ops(actions).values() for _, k, _ in ops}
    return "mixed" if {"B", "I"} <= kinds else "full" if "B" in kinds else "split"


@dataclass
class DeployedPlan:
    actions: dict[int, list[_Action]]
    warmup_counts: list[int]
    version: int
    hash: int
    reason: str
    kind: str  # initial | adaptive | forced | external
    backward: str = "split"  # split (I + W) | full (B) | mixed (both: backward="auto"'s initial plan)
    inflight_limit: list[int] | None = None  # the limit the plan was generated under (None: its counts)


@dataclass
class Candidate:
    """A validated, lowered plan waiting for agreement and the swap."""

    actions: dict[int, list[_Action]]
    lowered: dict[int, list[_Action]]
    mapping: dict[int, int]
    counts: list[int]
    hash: int
    kind: str
    reason: str
    backward: str = "split"
    trigger: str = ""  # the decision that asked for it; probe/select change only the backward variant
    prepare_ms: float = 0.0
    plan_ms: float = 0.0
    plan_cpu_ms: float = 0.0
    peak_inflight: int = 0  # most activations any stage holds (re-checked against the cap at the swap)
    inflight_limit: list[int] | None = None  # the limit the plan was generated and validated under
    plan: Any = None  # the planner's PlanResult (planner-made plans only): what a background polish starts from
    polish: dict | None = None  # a polished plan: the polish's report (``plan.polish.polish_plan``)
    #: a refine that found no plan its margin faster: the deployed plan stays (logged unchanged, never swapped)
    keep: bool = False


def lower(torch_actions: Mapping[int, list[_Action]], num_ranks: int, num_stages: int, n_microbatches: int,
          fsdp: bool, options: Mapping[str, Any] | None = None) -> tuple[dict[int, list[_Action]], dict[int, int]]:
    """torch's lowering passes of ``_prepare_schedule_with_comms``, on copies: (lowered, stage → rank).

    ``options``: torch 2.15's runtime keywords (``_torch_compat.lowering_options``, ``unshard_lookahead``
    resolved per rank), passed to the passes as torch's runtime passes them; None: torch's defaults."""
    opts = dict(options or {})
    mapping = _torch_schedules._validate_schedule(
        {r: list(a) for r, a in torch_actions.items()}, num_ranks, num_stages, n_microbatches)
    lowered = {}
    for r in torch_actions:
        # UNSHARD/RESHARD are no-ops for stages that FSDP does not wrap: skipped then
        acts = list(torch_actions[r])
        if fsdp and opts:
            acts = _torch_schedules._add_unshard_reshard(acts, max_active_stages=opts["max_active_stages"],
                                                         unshard_lookahead=opts["unshard_lookahead"][r])
        elif fsdp:
            acts = _torch_schedules._add_unshard_reshard(acts)
        lowered[r] = (_torch_schedules._add_reduce_grad(acts, n_microbatches,
                                                        defer_reduce_grad_wait=opts["defer_reduce_grad_wait"])
                      if opts.get("defer_reduce_grad_wait") else _torch_schedules._add_reduce_grad(acts, n_microbatches))
    lowered = _torch_schedules._add_send_recv(lowered, stage_to_rank=lambda st: mapping[st], num_stages=num_stages)
    lowered = add_send_waits(lowered)  # torch >= 2.15: WAIT_SEND_F/B, checked by torch
    if opts.get("max_outstanding_sends") is not None:
        lowered = _torch_schedules._add_wait_send_budget(lowered, stage_to_rank=lambda st: mapping[st],
                                                         max_outstanding_sends=opts["max_outstanding_sends"])
        _torch_schedules._validate_send_waits(lowered)
    return lowered, mapping


def check_plan(ops: Mapping[int, Sequence[Op]], *, num_stages: int, n_microbatches: int, num_ranks: int,
               inflight_limit: list[int] | int | None = None, stage_to_rank: Sequence[int] | None = None) -> None:
    """Pass 1: our validator on the plan IR (``validate_plan``; torch's dry run comes after the lowering, on
    the lowered lists), the plan covers every rank, and every rank runs only its own stages —
    ``stage_to_rank`` (several stages per rank, ``runtime/decide/placement.py``), else stage r on rank r."""
    validate_plan(ops, num_stages, n_microbatches, inflight_limit=inflight_limit, torch_dry_run=False,
                  release=RELEASE)
    if set(ops) != set(range(num_ranks)):
        raise PlanValidationError(f"plan covers ranks {sorted(ops)}, expected 0..{num_ranks - 1}")
    owner = stage_to_rank if stage_to_rank is not None else tuple(range(num_stages))
    for r, rank_ops in ops.items():
        if any(owner[st] != r for st, _, _ in rank_ops):
            raise PlanValidationError(f"rank {r} runs a stage it does not hold (its stages: "
                                      f"{[s for s, o in enumerate(owner) if o == r]})")


def to_torch_actions(ops: Mapping[int, Sequence[Op]]) -> dict[int, list[_Action]]:
    """Pass 2: the plan IR → torch's compute-only ``_Action`` lists (``titan_ext.plan.ir.to_torch_plan``).
    The runtime's one conversion: every plan it deploys (initial, re-plans, polish, explicit, external)
    reaches torch's IR here."""
    return _ir.to_torch_plan(ops)


def prepare_candidate(ops: Mapping[int, Sequence[Any]], counts: list[int] | None, kind: str, reason: str, *,
                      num_stages: int, n_microbatches: int, num_ranks: int, fsdp: bool = False,
                      inflight_limit: list[int] | int | None = None,
                      stage_to_rank: tuple[int, ...] | None = None,
                      lowering: Mapping[str, Any] | None = None) -> Candidate:
    """Validate and lower a compute-only plan (pure): the passes of the module docstring, in order.

    ``ops``: the plan IR, rank → ``(stage, kind, microbatch)`` tuples (``PlanResult.ops``); rank → torch
    actions is read into it first (``as_ops``: tests, torch's built-in plans). ``counts``: the plan's warm-up
    counts (None: read off the plan). Raises ``PlanValidationError`` (or what torch's lowering raises)
    when the plan is unsafe."""
    t0 = now()
    ops = as_ops(ops)  # op tuples are taken as they are (one pass that only checks them)
    check_plan(ops, num_stages=num_stages, n_microbatches=n_microbatches, num_ranks=num_ranks,
               inflight_limit=inflight_limit, stage_to_rank=stage_to_rank)
    torch_actions = to_torch_actions(ops)
    lowered, mapping = lower(torch_actions, num_ranks, num_stages, n_microbatches, fsdp, lowering)
    torch_dry_run_lowered(lowered, mapping, num_stages)
    counts = list(counts) if counts else warmup_counts_of(ops)
    return Candidate(torch_actions, lowered, mapping, counts, plan_hash(ops), kind, reason,
                     backward=backward_of(ops), prepare_ms=1e3 * (now() - t0),
                     peak_inflight=max(peak_inflight(ops, RELEASE).values(), default=0),
                     inflight_limit=[inflight_limit] * num_stages if isinstance(inflight_limit, int)
                     else list(inflight_limit) if inflight_limit is not None else None)


def external_plan(plan: Any, reason: Any) -> Any:
    """``schedule.deploy()``'s arguments checked: a :class:`~titan_ext.plan.PlanResult` as given, or a raw
    mapping rank → actions (earlier releases) copied as it is now; made a ``PlanResult`` only when deployed
    (:func:`external_candidate`), so a malformed one is rejected and logged like any invalid plan."""
    if isinstance(plan, Mapping):
        plan_arg(plan, "plan")
        plan = {r: list(a) for r, a in plan.items()}
    elif not isinstance(plan, PlanResult):
        raise ArgumentTypeError(f"plan must be a PlanResult (or, kept for compatibility, a mapping rank → "
                                f"list of actions), got {type(plan).__name__}")
    if not isinstance(reason, str):
        raise ArgumentTypeError(f"reason must be text, got {type(reason).__name__}")
    return plan


def external_candidate(plan: Any, reason: str, prepare: Any) -> Any:
    """The deferred candidate of an external plan (``prepare(ops, counts, kind, reason, limit)``: the
    schedule's lowering); a raw mapping becomes a ``PlanResult`` inside it, so its errors are rejections too."""
    def candidate() -> Candidate:
        result = plan if isinstance(plan, PlanResult) else make_result(
            plan, schedule="external", predicted_makespan_ms=math.nan, plan_ms=0.0)
        return prepare(result.ops, result.warmup_counts, "external", reason, result.inflight_limit)()

    return candidate
