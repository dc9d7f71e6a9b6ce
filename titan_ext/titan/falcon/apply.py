"""Falcon's decisions applied to the running DP x PP job (Falcon §5.3).

* ``pipemorph_replan``: the schedule's re-planning on (PipeMorph adapts the slow PP link);
* ``microbatch_redistribution`` (S2): the Eq. 1 split, in force from the next step;
* ``topology_adjustment`` (S3): the grid re-mapped in memory (:mod:`.s3`) when the plan moves
  a rank, then the job's own view of the layout;
* ``checkpoint_restart`` (S4): planned here (:mod:`.s4`), applied by the job once the step is
  recorded (checkpoint, exit, relaunch without the slow device).
"""

from __future__ import annotations

import json
import time
from typing import Any

from torchtitan.tools.logging import logger

__all__ = ["apply_all", "at_least_one_each"]


def apply_all(job: Any, decision: dict) -> tuple[dict[str, float | None], Any]:
    """Apply the step's Alg. 1 decisions: strategy → its measured cost for those applied (S4: None,
    the restarted job measures it), and S4's plan (None when not decided or not applicable)."""
    applied_s: dict[str, float | None] = {}
    s4_plan = None
    if not job.apply_decisions:
        return applied_s, s4_plan
    for strategy in filter(None, decision.get("falcon/apply", "").split(",")):
        t0 = time.perf_counter()
        if strategy == "checkpoint_restart":
            s4_plan = _plan_s4(job)
            if s4_plan is not None and _s4_pays(job, s4_plan, decision):
                applied_s[strategy] = None
            else:
                s4_plan = None
        elif _apply(job, strategy, decision):
            applied_s[strategy] = job.costs.measured[strategy] if strategy == "topology_adjustment" \
                else time.perf_counter() - t0
            logger.info(f"[titan_ext] Falcon applied {strategy} at step {job.trainer.step} (split {job.split}, "
                        f"grid {job.grid})")
    return applied_s, s4_plan


def _apply(job: Any, strategy: str, decision: dict) -> bool:
    """One decision other than S4; True when it changed the job."""
    if strategy == "pipemorph_replan":
        if getattr(job.trainer.pp_schedule, "adaptive", False):
            return False  # PipeMorph re-plans already: nothing to change
        job.trainer.pp_schedule.adaptive = True
    elif strategy == "microbatch_redistribution" and "falcon/plan/microbatch_split" in decision:
        job.split = at_least_one_each(json.loads(decision["falcon/plan/microbatch_split"]))
    elif strategy == "topology_adjustment":
        grid = json.loads(decision.get("falcon/plan/topology_grid", "null") or "null")
        if grid is None or grid == job.grid:
            logger.info(f"[titan_ext] Falcon decided S3 at step {job.trainer.step}; its plan keeps the grid "
                        f"{job.grid}: nothing to apply")
            return False
        _apply_topology(job, grid)
    return True


def _apply_topology(job: Any, grid: list[list[int]]) -> None:
    """S3 in memory (:func:`titan_ext.titan.falcon.s3.apply_topology`), then the job's own view of the
    layout (:meth:`FalconJob.bind_layout`), the data iterator, the S2 split re-planned for the new
    replicas; its measured time becomes S3's cost."""
    from titan_ext.titan.falcon.s3 import apply_topology

    loader = job.trainer.dataloader
    result = apply_topology(job.trainer, job.grid, grid, control_group=job.control)
    job.bind_layout([[int(r) for r in row] for row in grid], result.mesh["dp_replicate"].get_group())
    if job.trainer.dataloader is not loader:
        job.data_iterator = job.trainer.batch_generator(job.trainer.dataloader)
    if job.split != job.even_split:
        job.split = _replanned_split(job)
    job.costs.set_measured("topology_adjustment", result.seconds)
    logger.info(f"[titan_ext] Falcon S3: rank {job.rank} (dp, pp) {result.old_role} -> "
                f"{result.new_role}, state from rank {result.received_from}, {result.seconds:.3f} s")


def _replanned_split(job: Any) -> list[int]:
    """S2's split for the new replicas (Eq. 1 over the new grid's rows, as the monitor plans it)."""
    m = job.monitor
    if not m.slow_devices:
        return job.even_split
    # the new rows were not measured yet: modelled from the probe (the monitor's grid is the new one)
    return at_least_one_each(m.plan_microbatch_split(m.modelled_replica_slowdowns()))


def _s4_pays(job: Any, plan: Any, decision: dict) -> bool:
    """S4 only where it pays ("S4 when it pays"): the iteration time predicted after the
    restart (:meth:`FalconMonitor.predicted_after_exclusion`, in ``falcon/predicted_s/...``) must
    be below the current one, or below the one predicted for an S2 split applied in the same step.
    Dropping a 4x device's replica makes the other one take its chunks (dedicated-device
    emulation: 1.78 s a step predicted against 1.51 s with S2), so the restart would cost its
    start-up and then slow every step. Without measurements in the current segment, Alg. 1's
    decision stands (the paper)."""
    planned = job.split if job.split != job.monitor.split else None  # S2 applied this step
    pred = job.monitor.predicted_after_exclusion(plan.kept_replicas, plan.chunks_per_replica, planned)
    if pred is None:
        return True
    after, now = pred
    decision["falcon/predicted_s/checkpoint_restart"] = after
    if after < now:
        return True
    logger.warning(f"[titan_ext] Falcon decided checkpoint_restart at step {job.trainer.step}; not applied: "
                   f"{after:.3f} s a step predicted after it (replicas {plan.kept_replicas} with "
                   f"{plan.chunks_per_replica} chunks each) against {now:.3f} s now")
    return False


def _plan_s4(job: Any):
    """S4's plan (:func:`titan_ext.titan.falcon.s4.plan_checkpoint_restart`), or None (a warning says
    why) when it cannot apply."""
    from titan_ext.titan.falcon.s4 import S4Unavailable, plan_checkpoint_restart

    try:
        return plan_checkpoint_restart(job)
    except S4Unavailable as e:
        logger.warning(f"[titan_ext] Falcon decided checkpoint_restart at step {job.trainer.step}; "
                       f"not applied: {e}")
        return None


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
