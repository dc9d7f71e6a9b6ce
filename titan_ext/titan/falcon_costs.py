"""Falcon's strategy costs measured in the DP x PP job (the ski-rental inputs of
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

import dataclasses
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger

from titan_ext.runtime.falcon import device_clock
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
        parameters) to a DP peer over the data group, and loading it into a fresh stage. The move and
        the load are timed on probes of at most
        :data:`~titan_ext.runtime.falcon.device_clock.PROBE_BYTES` and scaled to the state's size
        (no copy of the stage, no buffer of its size: docs/falcon.md "Start-up memory"). The first
        application replaces this estimate by its own measured time."""
        from titan_ext.titan.falcon_s3 import grid_mesh, s3_can_move

        part = trainer.model_parts[0]
        if not s3_can_move(part):  # the same on every rank (one job-wide parallelism): no collective skipped
            logger.warning("[titan_ext] Falcon: S3 (in-memory topology change) moves plain modules only, this "
                           "stage is FSDP-wrapped (TorchTitan 0.3's DP x PP job): S3 is never chosen")
            self.set(topology_adjustment=math.inf)
            return
        state = [p.detach() for p in part.parameters()] * 3
        # S3's state move is a batched op of the moving ranks on the default group: its communicator
        # is made here, at start-up, by every rank (runtime/falcon/topology.py: exchange_stage_state)
        device_clock.ensure_communicator(None, device)
        t0 = time.perf_counter()
        grid_mesh(grid, torch.device(device).type)
        group_s = time.perf_counter() - t0
        move_s = _time_state_exchange(state, [row[pp_index] for row in grid], device)
        load_s = _time_state_load(state, device)
        self.set(topology_adjustment=self._slowest(group_s + move_s + load_s))


def _time_state_exchange(state: list[torch.Tensor], dp_ranks: list[int], device) -> float:
    """Seconds to send ``state`` to the next DP peer and receive the previous one's (a ring shift
    over the data group, device buffers; completion time), timed on a probe of at most
    ``PROBE_BYTES`` per direction and scaled to the state's fp32 size."""
    numel = sum(t.numel() for t in state)
    probe = device_clock.probe_numel(numel)
    send, recv = device_buffer(probe, device), device_buffer(probe, device)
    me = dp_ranks.index(dist.get_rank())
    timer = DeviceTimer(device)
    start = timer.mark()
    ops = [dist.P2POp(dist.isend, send, dp_ranks[(me + 1) % len(dp_ranks)], group=dist.group.WORLD),
           dist.P2POp(dist.irecv, recv, dp_ranks[(me - 1) % len(dp_ranks)], group=dist.group.WORLD)]
    return timer.completion_s(start, dist.batch_isend_irecv(ops)) * numel / probe


def _time_state_load(state: list[torch.Tensor], device) -> float:
    """Seconds to load ``state`` into a fresh stage (a device-to-device copy of every tensor), timed
    on a prefix of at most ``PROBE_BYTES`` and scaled to the whole state."""
    total = sum(t.numel() * t.element_size() for t in state)
    sample, nbytes = [], 0
    for t in state:
        if nbytes + t.numel() * t.element_size() > device_clock.PROBE_BYTES:
            break
        sample.append(t)
        nbytes += t.numel() * t.element_size()
    if not sample:  # one tensor larger than the probe: its first PROBE_BYTES
        flat = state[0].reshape(-1)
        sample = [flat[:device_clock.probe_numel(flat.numel(), flat.element_size())]]
        nbytes = sample[0].numel() * sample[0].element_size()
    timer = DeviceTimer(device)
    start = timer.mark()
    copies = [torch.empty_like(t).copy_(t) for t in sample]
    seconds = timer.elapsed_s(start, timer.mark())
    del copies
    return seconds * total / max(nbytes, 1)
