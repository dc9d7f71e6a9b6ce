"""Falcon in a TorchTitan DP × PP job on the CPU trainer (Falcon §4–§5): the per-step flow.

:class:`FalconJob` wires the parts, each in its own module:

* :mod:`.dp` — the DP gradient sum the trainer owns (TorchTitan 0.2.2 has no DDP next to PP),
  its timing, and the emulated slow DP link on it;
* :mod:`.emulate` — the other emulated faults (slow device, slow PP hop);
* :mod:`.measure` — iteration and per-group times every step (§4.2 / §4.3 profiling), the
  ACF iteration time, validation on onset (§4.3);
* :mod:`.costs` — the strategies' costs measured in this job (Alg. 1's inputs, §5.2);
* :mod:`.apply` — the decisions applied (§5.3: PipeMorph re-plan, S2, S3 in memory, S4);
* :mod:`.events` — ``falcon.jsonl``, ``falcon_events.jsonl``, console lines, W&B.

Every rank feeds the monitor the same numbers, so all take the same decision. Emulation keys:
``[titan_ext] emulate_slow_device`` / ``emulate_slow_link`` or ``TITAN_EXT_SLOW_DEVICE`` /
``TITAN_EXT_SLOW_LINK``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titan_ext.runtime.falcon import FalconConfig, FalconMonitor
from titan_ext.runtime.falcon.device_clock import control_group
from titan_ext.runtime.falcon.emulation import FailSlowEmulation, parse_slow_device, parse_slow_link
from titan_ext.runtime.falcon.redistribute import redistribute_chunks
from titan_ext.titan.falcon.apply import apply_all
from titan_ext.titan.falcon.costs import JobCosts
from titan_ext.titan.falcon.dp import DPSync
from titan_ext.titan.falcon.emulate import PPLinkDelays, install_compute_stretch
from titan_ext.titan.falcon.events import EventLog, event_rows
from titan_ext.titan.falcon.files import emulation_specs
from titan_ext.titan.falcon.measure import SLOW_DEVICE_RATIO, StepClock, acf_iteration_times, group_times, validate

__all__ = ["FalconJob"]


class FalconJob:
    """Falcon detection, validation and mitigation inside a :class:`TitanExtTrainer` (DP × PP)."""

    def __init__(self, trainer: Any, section: Any):
        self.trainer, self.section = trainer, section
        self.enabled, self.apply_decisions = section.falcon, section.falcon_apply
        self.rank = dist.get_rank()
        self.device = getattr(trainer, "device", torch.device("cpu"))
        self.control = control_group()  # host data on gloo control groups
        self.step_clock = StepClock(self.device)
        """The step's device time, fed to the detector (not the host clock)."""
        self.emulation = FailSlowEmulation(self.rank, range(dist.get_world_size()),
                                           *_parse(emulation_specs(section)),
                                           pass_s=section.emulate_device_pass_ms / 1e3)
        self.chunks_per_replica = trainer.gradient_accumulation_steps
        self.dp = DPSync(trainer, self.emulation, self.control, self.device)
        self.pp_delays = PPLinkDelays(self.emulation, self.rank)
        dp_mesh = trainer.parallel_dims.get_mesh("dp_replicate")
        self.num_dp, self.num_pp = dp_mesh.size(), trainer.parallel_dims.get_mesh("pp").size()
        self.even_split = [self.chunks_per_replica] * self.num_dp
        self.split = list(self.even_split)
        self.monitor = self._monitor()
        self.bind_layout(self._mesh_grid(), dp_mesh.get_group())
        from titan_ext.titan.adapters import current

        dump = Path(current().trainer_dump_folder(trainer))
        self.log = EventLog(trainer, dump if self.enabled else None, self.rank)
        self.costs = JobCosts(self.monitor, self.control)
        self.costs.measure_s3(trainer, self.grid, self.pp_index, self.device)
        from titan_ext.titan.falcon.s4 import estimate_s4_cost

        self.costs.set(checkpoint_restart=estimate_s4_cost(self, dump))
        self.data_iterator = None
        """The iterator the steps read after S3 moved this rank to another DP replica (else the
        trainer's)."""
        self._exchange_measured = False
        self._fed_from: int | None = None
        """The first training step fed to the detector (:meth:`_observe`)."""
        self._backwards_left = 0
        self.last_decision: dict = {}

    def _monitor(self) -> FalconMonitor:
        return FalconMonitor(
            FalconConfig(num_microbatches=self.chunks_per_replica * self.num_dp,
                         slow_device_ratio=SLOW_DEVICE_RATIO),
            pp_groups={f"pp{d}_link{i}": i for d in range(self.num_dp) for i in range(self.num_pp - 1)},
            dp_groups=[f"dp_stage{s}" for s in range(self.num_pp)],
        )

    def _mesh_grid(self) -> list[list[int]]:
        """``grid[dp][pp]`` = global rank, from TorchTitan's mesh (gathered on the control group)."""
        dims = self.trainer.parallel_dims
        coords: list = [None] * dist.get_world_size()
        dist.all_gather_object(coords, (dims.get_mesh("dp_replicate").get_local_rank(),
                                        dims.get_mesh("pp").get_local_rank()), group=self.control)
        grid = [[0] * self.num_pp for _ in range(self.num_dp)]
        for r, (d, s) in enumerate(coords):
            grid[d][s] = r
        return grid

    def bind_layout(self, grid: list[list[int]], dp_group: Any) -> None:
        """This rank's view of the layout (at start and after S3): roles, DP groups, the monitor's
        grid, the emulated faults' hooks on the current model part and pipeline, the DP sync."""
        self.grid = grid
        self.dp_index, self.pp_index = next((d, s) for d, row in enumerate(grid) for s, r in enumerate(row)
                                            if r == self.rank)
        self.dp_group = dp_group
        dp_controls = [control_group([row[s] for row in grid]) for s in range(self.num_pp)]  # collective
        self.dp_control = dp_controls[self.pp_index]
        self.monitor.grid = [list(row) for row in grid]
        if getattr(self.trainer.pp_schedule, "falcon", None) is not None:
            self.trainer.pp_schedule.falcon = None  # the job's monitor sees DP too; one monitor decides
        for part in self.trainer.model_parts:
            install_compute_stretch(part, self.emulation, self.device)
        self.pp_delays.remove()
        self.dp.regroup(dp_group, self.dp_control, [row[self.pp_index] for row in grid], self.pp_index,
                        self.num_pp)

    # ---------------------------------------------------------------- the step
    def train_step(self, run_step, data_iterator) -> None:
        """One TorchTitan step with this job's micro-batch split; then Falcon, fed the step's device
        time (:class:`~.measure.StepClock`)."""
        if self.enabled:
            self.step_clock.start()
        self.emulation.step = self.trainer.step
        self.pp_delays.maybe_install(self.grid[self.dp_index])
        chunks = self._my_chunks(self.data_iterator or data_iterator)
        self.trainer.gradient_accumulation_steps = len(chunks)
        self._backwards_left = len(chunks)
        self.dp.step_started()
        run_step(iter(chunks))
        if self.enabled:
            self._falcon(self.step_clock.stop_s())

    def after_backward(self) -> None:
        """Called after every forward/backward of a chunk: the last one syncs the DP replicas."""
        self._backwards_left -= 1
        if self._backwards_left == 0:
            self.dp.sync()

    def _my_chunks(self, data_iterator) -> list:
        """This replica's chunks of the step: its own loader's (even split), or under S2 its range
        of the global batch (every replica's chunks, exchanged over the DP group)."""
        mine = [next(data_iterator) for _ in range(self.chunks_per_replica)]
        if not self._exchange_measured:
            self.costs.measure_exchange(mine, self.even_split, self.dp_index, self.dp_control)
            self._exchange_measured = True
        if self.split == self.even_split:
            return mine
        return redistribute_chunks(mine, self.split, self.dp_index, self.dp_control)

    def _falcon(self, step_s: float) -> None:
        """Falcon after a step: measure, detect, validate on onset, decide (Alg. 1), apply, record;
        S4 last, once the step is recorded (it exits)."""
        acf = acf_iteration_times(self.monitor)
        iteration_s, groups = group_times(self, step_s)
        measured_t = json.dumps(self.monitor.replica_microbatch_s)  # observe() consumes it
        decision = self._observe(iteration_s, groups) | acf
        decision["falcon/replica_microbatch_s"] = measured_t
        decision |= {f"falcon/group_s/{g}": t for g, t in groups.items()}
        if decision.get("falcon/validate"):
            decision |= validate(self)
        estimated = self.monitor.config.costs  # the ski-rental inputs, before an application re-measures
        applied_s, s4_plan = apply_all(self, decision)
        decision["falcon/split"] = json.dumps(self.split)
        decision["falcon/grid"] = json.dumps(self.grid)
        self.last_decision = decision
        self.log.record(decision, event_rows(self.trainer.step, decision, self.monitor, estimated, applied_s,
                                             self.apply_decisions))
        if s4_plan is not None:
            from titan_ext.titan.falcon.s4 import checkpoint_and_exit

            checkpoint_and_exit(self, s4_plan, decision)

    def _observe(self, iteration_s: float, groups: dict[str, float]) -> dict:
        """Feed the monitor (§4.2) from this process's second step on. Its first step is a warm-up
        whose time includes one-off work — S2's cost measured by a real chunk exchange, PipeMorph's
        first plan and profile, first allocations — and is no sample of the healthy iteration time:
        with a fault from step 5 the detector has 3 healthy steps, and a slow first one among them
        delayed the onset (measured on a slow DP link's series: confirmed at step 14 with it, at
        step 10 without). The change point is also reported as a training step."""
        if self._fed_from is None:
            self._fed_from = self.trainer.step + 1
            return {"falcon/iteration_time_s": iteration_s, "falcon/warmup": 1}
        decision = self.monitor.observe(iteration_s, groups)
        if "falcon/change_point_iteration" in decision:
            decision["falcon/change_point_step"] = self._fed_from + decision["falcon/change_point_iteration"]
        return decision


def _parse(specs: tuple[str, str]) -> tuple:
    device_spec, link_spec = specs
    return parse_slow_device(device_spec), parse_slow_link(link_spec)
