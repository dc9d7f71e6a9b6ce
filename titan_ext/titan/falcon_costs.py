"""Falcon's strategy costs measured in the DP x PP job (issue 23 item 3; the ski-rental inputs of
Alg. 1, Falcon §5.2): no constants — every cost is this job's own measurement, the slowest rank's.

* S1 (ignore): 0.
* S2 (micro-batch redistribution): one real exchange of the step's chunks over the DP group, at the
  first step (:meth:`JobCosts.measure_exchange`).
* PipeMorph's re-plan: its own last planning + swap time (:meth:`JobCosts.measure_replan`).
* S3 (topology change in memory): at start an estimate from its parts (:meth:`JobCosts.measure_s3`),
  replaced by the measured time of the whole change once it ran.
* S4 (checkpoint-and-restart): :func:`titan_ext.titan.falcon_s4.estimate_s4_cost`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger

from titan_ext.runtime.falcon.device_clock import DeviceTimer, device_buffer
from titan_ext.runtime.falcon.redistribute import redistribute_chunks

__all__ = ["JobCosts"]


class JobCosts:
    """The monitor's :class:`~titan_ext.runtime.falcon.StrategyCosts`, kept to this job's measurements."""

    def __init__(self, monitor: Any, control: Any):
        self.monitor, self.control = monitor, control
        self.measured: dict[str, float] = {"ignore": 0.0}
        """Strategy → its cost measured in this job (seconds, slowest rank's)."""

    def set(self, **costs: float) -> None:
        """Costs the ski rental uses from now on (one value on every rank)."""
        new = dataclasses.replace(self.monitor.config.costs, **costs)
        self.monitor.config.costs = new
        self.monitor.planner.costs = new

    def set_measured(self, strategy: str, seconds: float) -> None:
        """``strategy``'s cost as measured in this job (pass the slowest rank's): the entry point for
        measured costs."""
        self.measured[strategy] = float(seconds)
        self.set(**{strategy: float(seconds)})

    def _slowest(self, seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return float(t[0])

    def measure_exchange(self, mine: list, even_split: list[int], dp_index: int, dp_control: Any) -> None:
        """S2's overhead: one real exchange of this step's chunks over the DP group."""
        t0 = time.perf_counter()
        redistribute_chunks(mine, even_split, dp_index, dp_control)
        self.set_measured("microbatch_redistribution", self._slowest(time.perf_counter() - t0))

    def measure_replan(self, rt: dict) -> None:
        """pipemorph_replan's overhead: PipeMorph's own last planning + swap time."""
        ms = float(rt.get("plan_ms", math.nan)) + float(rt.get("swap_ms", 0.0) or 0.0)
        if math.isfinite(ms):
            self.set_measured("pipemorph_replan", ms / 1e3)

    def measure_s3(self, trainer: Any, grid: list[list[int]], pp_index: int, device) -> None:
        """S3's overhead as this job applies it, in memory: creating a device mesh of the current grid
        (the new DP and PP groups), moving a stage's state (the model and AdamW's two moments, 3x the
        parameters) to a DP peer over the data group, and loading a copy of it into a fresh copy of
        the stage. The first application replaces this estimate by its own measured time."""
        from titan_ext.runtime.falcon.topology import load_stage_state, own_stage_state
        from titan_ext.titan.falcon_s3 import grid_mesh, s3_can_move

        part, opt = trainer.model_parts[0], trainer.optimizers.optimizers[0]
        if not s3_can_move(part):  # the same on every rank (one job-wide parallelism): no collective skipped
            logger.warning("[titan_ext] Falcon: S3 (in-memory topology change) moves plain modules only, this "
                           "stage is FSDP-wrapped (TorchTitan 0.3's DP x PP job): S3 is never chosen")
            self.set(topology_adjustment=math.inf)
            return
        state = [p.detach() for p in part.parameters()] * 3
        t0 = time.perf_counter()
        grid_mesh(grid, torch.device(device).type)
        group_s = time.perf_counter() - t0
        move_s = _time_state_exchange(state, [row[pp_index] for row in grid], device)
        t0 = time.perf_counter()
        fresh = copy.deepcopy(part)
        load_stage_state(fresh, type(opt)(fresh.parameters()), *own_stage_state(part, opt))
        self.set(topology_adjustment=self._slowest(group_s + move_s + time.perf_counter() - t0))


def _time_state_exchange(state: list[torch.Tensor], dp_ranks: list[int], device) -> float:
    """Seconds to send ``state`` to the next DP peer and receive the previous one's (a ring shift
    over the data group, device buffers; completion time)."""
    numel = sum(t.numel() for t in state)
    send, recv = device_buffer(numel, device), device_buffer(numel, device)
    me = dp_ranks.index(dist.get_rank())
    timer = DeviceTimer(device)
    start = timer.mark()
    ops = [dist.P2POp(dist.isend, send, dp_ranks[(me + 1) % len(dp_ranks)]),
           dist.P2POp(dist.irecv, recv, dp_ranks[(me - 1) % len(dp_ranks)])]
    return timer.completion_s(start, dist.batch_isend_irecv(ops))
