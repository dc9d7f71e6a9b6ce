"""What a Falcon decision changes in the running DP x PP job (Falcon §5.3), decided from explicit
inputs: :func:`plan_changes` (a :class:`~titan_ext.runtime.falcon.FalconDecision` and a
:class:`JobView` of the job) → a frozen :class:`JobChanges`, which :class:`~titan_ext.titan.falcon_job.FalconJob` applies.

* ``pipemorph_replan``: the schedule's re-planning on (PipeMorph adapts the slow PP link);
* ``microbatch_redistribution`` (S2): the Eq. 1 split, in force from the next step;
* ``topology_adjustment`` (S3): the grid re-mapped in memory (:mod:`~titan_ext.titan.falcon_s3`) when the plan moves a rank;
  with ``[titan_ext] falcon_delegation``, a slow link it moved onto a PP hop is then PipeMorph's:
  re-planning on and the moved link's PP messages delegated (PipeMorph §7.3, Fig. 19);
* ``checkpoint_restart`` (S4): planned here (:func:`~titan_ext.runtime.falcon.restart.plan_checkpoint_restart`) and kept only where
  it pays (:func:`s4_pays`); the job applies it once the step is recorded (checkpoint, exit,
  relaunch without the slow device).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["JobView", "JobChanges", "plan_changes", "pp_hops", "s4_pays", "replanned_split", "at_least_one_each"]


@dataclass(frozen=True)
class JobView:
    """What :func:`plan_changes` reads of the job (nothing else): the training step, the split in
    force, the even split, the grid, whether PipeMorph re-plans already, whether TorchTitan's
    checkpointer is on (S4 needs it) and whether decisions are applied at all."""

    step: int
    split: tuple[int, ...]
    even_split: tuple[int, ...]
    grid: tuple[tuple[int, ...], ...]
    replanning_on: bool
    checkpoint_enabled: bool
    apply_decisions: bool = True
    delegate_after_s3: bool = False
    spares: tuple[int, ...] = ()
    """``[titan_ext] falcon_spares``: devices S4 may restart a slow device's rank on."""
    device_of: tuple[int, ...] | None = None
    """The device of each rank (``falcon_devices``; None: identity)."""
    """``[titan_ext] falcon_delegation``: after S3 moved a slow link onto a PP hop, re-plan and
    delegate it (PipeMorph §7.3)."""


@dataclass(frozen=True)
class JobChanges:
    """A decision's effect on the job. ``replan``: turn PipeMorph's re-planning on; ``split``: S2's
    split from the next step; ``grid``: S3's new grid (a plan that moves a rank); ``s4_plan``: S4's
    :class:`~titan_ext.runtime.falcon.restart.ExclusionPlan` (checkpoint and exit after the step is
    recorded); ``applied``: the strategies that change the job, in decision order; ``metrics``:
    entries the decision gains (S4's predicted step); ``notes``: (level, line) for the log;
    ``delegate_links``: slow links S3 moved onto a PP hop whose pipelines now re-plan and delegate
    (PipeMorph §7.3: a DP straggler turned into a PP one, which PipeMorph absorbs)."""

    replan: bool = False
    split: tuple[int, ...] | None = None
    grid: tuple[tuple[int, ...], ...] | None = None
    s4_plan: Any = None
    applied: tuple[str, ...] = ()
    metrics: dict = field(default_factory=dict)
    notes: tuple[tuple[str, str], ...] = ()
    delegate_links: tuple[tuple[int, int], ...] = ()


def plan_changes(decision: Any, view: JobView, monitor: Any) -> JobChanges:
    """The job's changes for the step's Alg. 1 decisions (``decision.apply``). ``monitor`` is read
    only (validation's slow devices / links, S4's predicted step from the measured chunk times)."""
    if not view.apply_decisions:
        return JobChanges()
    replan, split, grid, s4_plan, delegate = False, None, None, None, ()
    applied: list[str] = []
    metrics: dict = {}
    notes: list[tuple[str, str]] = []
    for strategy in decision.apply:
        if strategy == "ignore":
            applied.append(strategy)  # S1: nothing to change, applied as decided
        elif strategy == "pipemorph_replan":
            if not view.replanning_on:  # a schedule that re-plans already is not changed
                replan = True
                applied.append(strategy)
        elif strategy == "microbatch_redistribution":
            if decision.microbatch_split is not None:
                split = tuple(at_least_one_each(list(decision.microbatch_split)))
                applied.append(strategy)
        elif strategy == "topology_adjustment":
            new = decision.topology_grid
            if new is not None and not _rank_ordered(new):
                alt = _plan_for_root(view.grid, monitor)
                notes.append(("warning", f"Falcon S3 at step {view.step}: the plan {[list(r) for r in new]} has a "
                                         f"pipeline out of global-rank order (torch numbers a PP group's members by "
                                         f"global rank); " + (f"planned for {monitor.root_component} alone: "
                                                              f"{[list(r) for r in alt]}" if alt is not None
                                                              else "no ordered plan for the root component")))
                new = alt
            if new is None or [list(r) for r in new] == [list(r) for r in view.grid]:
                notes.append(("info", f"Falcon decided S3 at step {view.step}; its plan keeps the grid "
                                      f"{[list(r) for r in view.grid]}: nothing to apply"))
            else:
                grid = tuple(tuple(int(x) for x in r) for r in new)
                applied.append(strategy)
                if view.delegate_after_s3:
                    # the root component's link (validation on a loaded host may flag a second one:
                    # seen in the Fig. 19 bench, 3->2, and both pipelines then delegated)
                    root = getattr(monitor, "root_key", None)
                    moved = tuple(k for k in pp_hops(monitor.slow_links, grid)
                                  if root is None or len(root) != 2 or k == tuple(root))
                    if moved:
                        delegate = moved
                        replan = True
                        metrics["falcon/plan/delegate_links"] = json.dumps([list(k) for k in moved])
        elif strategy == "checkpoint_restart":
            from titan_ext.runtime.falcon.restart import S4Unavailable, plan_checkpoint_restart

            try:
                plan = plan_checkpoint_restart(view.checkpoint_enabled, monitor.slow_devices, monitor.slow_links,
                                               [list(r) for r in view.grid], view.step, list(split or view.split),
                                               spares=view.spares, device_of=view.device_of)
            except S4Unavailable as e:
                notes.append(("warning", f"Falcon decided checkpoint_restart at step {view.step}; not applied: {e}"))
                continue
            planned = list(split) if split is not None and split != tuple(view.split) else None  # S2 this step
            pays, predicted, now = s4_pays(monitor, plan, planned)
            if predicted is not None:
                metrics["falcon/predicted_s/checkpoint_restart"] = predicted
            if pays:
                s4_plan = plan
                applied.append(strategy)
            else:
                notes.append(("warning", f"Falcon decided checkpoint_restart at step {view.step}; not applied: "
                                         f"{predicted:.3f} s a step predicted after it (replicas "
                                         f"{plan.kept_replicas} with {plan.chunks_per_replica} chunks each) "
                                         f"against {now:.3f} s now"))
    return JobChanges(replan, split, grid, s4_plan, tuple(applied), metrics, tuple(notes), delegate)


def _rank_ordered(grid) -> bool:
    return all(list(r) == sorted(r) for r in grid)


def _plan_for_root(grid, monitor: Any):
    """S3's plan for the root component alone (a spurious second slow link — validation noise on a
    loaded host — can leave no plan with every pipeline in global-rank order), or None."""
    from titan_ext.runtime.falcon import plan_topology

    key = getattr(monitor, "root_key", None)
    if key is None:
        return None
    links = [(a, b) for a, b in monitor.slow_links if tuple(sorted((a, b))) == tuple(key)] if len(key) == 2 else []
    devices = [key[0]] if len(key) == 1 else []
    plan = plan_topology([list(r) for r in grid], links, devices)
    return plan.grid if plan.moved and _rank_ordered(plan.grid) else None


def pp_hops(links, grid) -> tuple[tuple[int, int], ...]:
    """The links (either direction, reported once, sorted) that join adjacent stages of one pipeline
    of ``grid[dp][pp]``."""
    pos = {r: (d, s) for d, row in enumerate(grid) for s, r in enumerate(row)}
    out = []
    for a, b in links:
        key = tuple(sorted((int(a), int(b))))
        if a in pos and b in pos and key not in out:
            (da, sa), (db, sb) = pos[a], pos[b]
            if da == db and abs(sa - sb) == 1:
                out.append(key)
    return tuple(sorted(out))


def s4_pays(monitor: Any, plan: Any, planned_split: list[int] | None) -> tuple[bool, float | None, float | None]:
    """S4 only where it pays ("S4 when it pays"): the iteration time predicted after the
    restart (:meth:`FalconMonitor.predicted_after_exclusion`) must be below the current one, or below
    the one predicted for an S2 split (``planned_split``) applied in the same step. Dropping a 4x
    device's replica makes the other one take its chunks (dedicated-device emulation: 1.78 s a step
    predicted against 1.51 s with S2), so the restart would cost its start-up and then slow every
    step. Without measurements in the current segment, Alg. 1's decision stands (the paper).
    Returns (pays, predicted after, now)."""
    if getattr(plan, "replaced", None):  # onto spares: the same grid on healthy devices
        healthy = getattr(monitor.detector, "healthy_mean_s", None)
        now = getattr(monitor.detector, "current_mean_s", None)
        if healthy is None or now is None:
            return True, None, None
        return healthy < now, float(healthy), float(now)
    pred = monitor.predicted_after_exclusion(plan.kept_replicas, plan.chunks_per_replica, planned_split)
    if pred is None:
        return True, None, None
    after, now = pred
    return after < now, after, now


def replanned_split(monitor: Any, even_split: list[int]) -> list[int]:
    """S2's split for the replicas of a new grid (after S3; the monitor's grid is the new one): Eq. 1
    over its rows, modelled from the probe (the new rows were not measured yet)."""
    if not monitor.slow_devices:
        return list(even_split)
    return at_least_one_each(monitor.plan_microbatch_split(monitor.modelled_replica_slowdowns()))


def at_least_one_each(split: list[int]) -> list[int]:
    """Eq. 1's split with every replica keeping one chunk (a replica with none would not reach the
    DP all-reduce, which runs after its last backward); the chunks come from the largest share."""
    split = list(split)
    for i, m in enumerate(split):
        if m < 1:
            j = max(range(len(split)), key=split.__getitem__)
            split[j] -= 1 - m
            split[i] = 1
    return split
