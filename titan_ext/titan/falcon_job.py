"""Falcon in a TorchTitan DP × PP job on the CPU trainer (Falcon §4–§5): the per-step flow.

:class:`FalconJob` wires the parts, each in its own module:

* :mod:`~titan_ext.titan.falcon_dp` — the DP gradient sum the trainer owns (TorchTitan 0.2.2 has no DDP next to PP),
  its timing, and the emulated slow DP link on it;
* :mod:`~titan_ext.titan.falcon_emulate` — the other emulated faults (slow device, slow PP hop);
* :mod:`~titan_ext.runtime.falcon.measure` — the step's :class:`IterationObservation`: iteration and per-group times (§4.2 / §4.3 profiling), the
  ACF iteration time, validation on onset (§4.3);
* :mod:`~titan_ext.titan.falcon_costs` — the strategies' costs measured in this job (Alg. 1's inputs, §5.2);
* :mod:`~titan_ext.runtime.falcon.apply` — what a decision changes (§5.3: PipeMorph re-plan, S2, S3 in memory, S4), a frozen
  :class:`~titan_ext.runtime.falcon.apply.JobChanges` that :meth:`FalconJob.apply` carries out;
* :mod:`~titan_ext.titan.falcon_events` — ``falcon.jsonl``, ``falcon_events.jsonl``, console lines, W&B.

Every rank feeds the monitor the same numbers, so all take the same decision. A steady step makes
no device sync: the step's device times are read once the device ran them and exchanged as host
data (:class:`~titan_ext.runtime.falcon.measure.StepClock`, :class:`~titan_ext.runtime.falcon.measure.ObservationExchange`) at a check, every
``[titan_ext] falcon_check_every`` steps and at the last step — one MAX reduction by recursive
doubling on the gloo control group (log2 world message rounds), carrying every step since the
previous check — so the monitor sees every step, in order, the same steps on every rank: step k at
the first check after it on the CPU, a step or two later on a GPU. Emulation keys:
``[titan_ext] emulate_slow_device`` / ``emulate_slow_link`` or ``TITAN_EXT_SLOW_DEVICE`` /
``TITAN_EXT_SLOW_LINK``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titan_ext.runtime.falcon import FalconConfig, FalconDecision, FalconMonitor, IterationObservation
from titan_ext.runtime.falcon.device_clock import control_group, ensure_communicator
from titan_ext.runtime.falcon.emulation import FailSlowEmulation, parse_slow_device, parse_slow_link
from titan_ext.runtime.falcon.redistribute import redistribute_chunks
from torchtitan.tools.logging import logger

from titan_ext.titan.adapters import last_training_step
from titan_ext.runtime.falcon.apply import JobChanges, JobView, plan_changes, replanned_split
from titan_ext.titan.falcon_costs import JobCosts
from titan_ext.titan.falcon_dp import DPSync
from titan_ext.titan.falcon_emulate import PPLinkDelays, install_compute_stretch
from titan_ext.titan.falcon_events import EventLog, event_rows
from titan_ext.runtime.falcon.files import emulation_specs
from titan_ext.runtime.falcon.measure import (SLOW_DEVICE_RATIO, ObservationExchange, StepClock, StepRecord,
                                            acf_iteration_times, validate)

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
        """The step's device time, fed to the detector (not the host clock), and the DP sync's marks."""
        self.device_of = _devices(section.falcon_devices, dist.get_world_size())
        self.spares = tuple(_devices(section.falcon_spares, None)) if section.falcon_spares.strip() else ()
        self.emulation = FailSlowEmulation(self.rank, self.device_of,
                                           *_parse(emulation_specs(section)),
                                           pass_s=section.emulate_device_pass_ms / 1e3,
                                           window_bytes=section.emulate_link_window_kib * 1024 or float("inf"))
        self.chunks_per_replica = trainer.gradient_accumulation_steps
        self.dp = DPSync(trainer, self.emulation, self.control, self.device, clock=self.step_clock)
        self.pp_delays = PPLinkDelays(self.emulation, self.rank, hol=section.emulate_link_hol,
                                      hol_hold=section.emulate_link_hol_hold)
        dp_mesh = trainer.parallel_dims.get_mesh("dp_replicate")
        self.num_dp, self.num_pp = dp_mesh.size(), trainer.parallel_dims.get_mesh("pp").size()
        self.even_split = [self.chunks_per_replica] * self.num_dp
        self.split = list(self.even_split)
        self.check_every = int(section.falcon_check_every)
        """Steps between two exchanges of the steps' numbers (Falcon's checks; and the last step)."""
        self.exchange = ObservationExchange(self.control, self.num_pp, self.num_dp, every=self.check_every)
        self.last_step = last_training_step(trainer)
        """The job's last training step (its check feeds every step run; None: unknown)."""
        self._steps = 0  # the job's steps so far (the exchange's step index)
        self._link_delay_ms: dict = {}
        """The PP link delays of PipeMorph's last check, held between checks (the schedule measures
        them at its checks only, every ``profile_every`` .. ``profile_every_max`` iterations, once the
        job took Falcon off it)."""
        self._version = 0
        """Bumped by every applied change (:meth:`apply`): a step run under an older one is not fed."""
        self.stale_steps = 0
        """Steps not fed because a change was applied after they started (only where the device runs
        behind the host: on the CPU a step is fed at its own end)."""
        self.monitor = self._monitor()
        self.bind_layout(self._mesh_grid(), dp_mesh.get_group())
        from titan_ext.titan.adapters import current

        dump = Path(current().trainer_dump_folder(trainer))
        self.log = EventLog(trainer, dump if self.enabled else None, self.rank)
        self.costs = JobCosts(self.monitor, self.control)
        self.costs.measure_s3(trainer, self.grid, self.pp_index, self.device)
        from titan_ext.titan.falcon_s4 import estimate_s4_cost

        self.costs.set(checkpoint_restart=estimate_s4_cost(self, dump))
        self.data_iterator = None
        """The iterator the steps read after S3 moved this rank to another DP replica (else the
        trainer's)."""
        self._exchange_measured = False
        self._fed_from: int | None = None
        """The first training step fed to the detector (:meth:`_observe`)."""
        self._backwards_left = 0
        self.delegated_links: list[tuple[int, int]] = []
        self.last_decision: FalconDecision = FalconDecision(-1)

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
        self.pp_group = self.trainer.parallel_dims.get_mesh("pp").get_group()
        # validation's ring passes are batched P2P ops of a subset of these groups' ranks: their
        # communicators are made now, by all members (device_clock.ensure_communicator), not at the
        # moment of a diagnosis (collective over each group, every rank in the same order)
        ensure_communicator(self.pp_group, self.device)
        ensure_communicator(self.dp_group, self.device)
        dp_controls = [control_group([row[s] for row in grid]) for s in range(self.num_pp)]  # collective
        self.dp_control = dp_controls[self.pp_index]
        self.monitor.set_grid(grid)
        self.exchange.order(grid)  # a pipeline's ranks paired first (the same order on every rank)
        if getattr(self.trainer.pp_schedule, "falcon", None) is not None:
            self.trainer.pp_schedule.falcon = None  # the job's monitor sees DP too; one monitor decides
        for part in self.trainer.model_parts:
            install_compute_stretch(part, self.emulation, self.device)
        self.pp_delays.remove()
        self.dp.regroup(dp_group, self.dp_control, [row[self.pp_index] for row in grid], self.pp_index,
                        self.num_pp)

    # ---------------------------------------------------------------- the step
    def train_step(self, run_step, data_iterator) -> None:
        """One TorchTitan step with this job's micro-batch split; then Falcon, fed the steps whose
        device times every rank has read (:meth:`_after_step`)."""
        if self.enabled:
            self.step_clock.start(self._steps)
        self.emulation.step = self.trainer.step
        self.pp_delays.maybe_install(self.grid[self.dp_index])
        chunks = self._my_chunks(self.data_iterator or data_iterator)
        self.trainer.gradient_accumulation_steps = len(chunks)
        self._backwards_left = len(chunks)
        self.dp.step_started()
        run_step(iter(chunks))
        if self.enabled:
            self._after_step()
        self._steps += 1

    def _after_step(self) -> None:
        """End the step on the device clock with the host values it ran with (no decision has
        changed them since it started: decisions are applied at a check, after this); read the
        steps the device finished (no wait; at the last step, waiting: training ends). At a check
        (every :attr:`check_every` steps, and the last step) exchange every step not fed yet and run
        Falcon on each step every rank has read, oldest first (the same steps on every rank) — except
        a step run under a layout or split that a decision changed since (its numbers describe a
        configuration that no longer runs: the monitor's before/after comparisons stay within one),
        which is recorded only; S4 (checkpoint and exit) once the check's steps are recorded."""
        from titan_ext.titan.metrics import runtime_metrics

        step = self.step_clock.stop()
        rt = runtime_metrics(self.trainer.pp_schedule)
        self.costs.measure_replan(rt)  # only a Falcon decision's ski-rental input
        if rt.get("link_delay_ms"):  # a check of PipeMorph's: its readings, held until the next one
            self._link_delay_ms = dict(rt["link_delay_ms"])
        step.host = {"split": list(self.split), "dp_index": self.dp_index, "pp_index": self.pp_index,
                     "link_delay_ms": dict(self._link_delay_ms), "trainer_step": self.trainer.step,
                     "version": self._version}
        self.exchange.add(step)
        last = self.last_step is not None and self.trainer.step >= self.last_step
        for read in (self.step_clock.drain() if last else self.step_clock.read()):
            self.dp.step_read(read)
        if not (last or (self._steps + 1) % self.check_every == 0):
            return
        s4 = None
        for done, obs, reduce_s in self.exchange.exchange():
            self.dp.absorb(reduce_s)
            if s4 is None and done.host["version"] == self._version:
                s4 = self._falcon(obs, done)
            else:
                self.stale_steps += 1
                self._record_stale(obs, done)
        if s4 is not None:
            from titan_ext.titan.falcon_s4 import checkpoint_and_exit

            checkpoint_and_exit(self, *s4)

    def _record_stale(self, obs: IterationObservation, step: StepRecord) -> None:
        """A step not fed (run before a change this check applied): its row, the split and grid in
        force now, as every row records them."""
        self.log.record({"falcon/stale": 1, "falcon/iteration_time_s": obs.iteration_time_s,
                         "falcon/split": json.dumps(self.split), "falcon/grid": json.dumps(self.grid),
                         "falcon/observed_step": step.host["trainer_step"],
                         "falcon/check_step": self.trainer.step}, [], step=step.host["trainer_step"])

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

    def _falcon(self, obs: IterationObservation, step: StepRecord) -> tuple | None:
        """Falcon on a step's exchanged observation (:class:`IterationObservation`, every rank's):
        detect, validate on onset, decide (Alg. 1: a :class:`FalconDecision`), plan the job's changes
        (:func:`~titan_ext.runtime.falcon.apply.plan_changes`: a :class:`~titan_ext.runtime.falcon.apply.JobChanges`), apply them (from the next
        step), record — the row under the observed step, the events under this check's step (where
        the change was applied; ``observed_step``: the step that decided). Returns S4's
        ``(plan, decision)`` when S4 was decided (the caller checkpoints and exits), else None."""
        acf = acf_iteration_times(self.monitor)
        decision = self._observe(obs, step.host["trainer_step"])
        decision = decision.with_metrics(
            acf | {"falcon/replica_microbatch_s": json.dumps(list(obs.replica_microbatch_s))}
            | {f"falcon/group_s/{g}": t for g, t in obs.per_group_times.items()})
        if decision.validate:
            decision = decision.with_metrics(validate(self.monitor, grid=self.grid, emulation=self.emulation,
                                                      control=self.control, device=self.device,
                                                      ring_groups=self.ring_groups()))
        estimated = self.monitor.config.costs  # the ski-rental inputs, before an application re-measures
        changes = plan_changes(decision, self.view(), self.monitor)
        applied_s = self.apply(changes)
        decision = decision.with_metrics(changes.metrics | {"falcon/split": json.dumps(self.split),
                                                            "falcon/grid": json.dumps(self.grid),
                                                            "falcon/observed_step": step.host["trainer_step"],
                                                            "falcon/check_step": self.trainer.step})
        if changes.delegate_links:  # what this rank's pipeline delegates now (the plan: falcon/plan/...)
            decision = decision.with_metrics({"falcon/delegated_links": json.dumps(
                [list(k) for k in self.delegated_links])})
        self.last_decision = decision
        observed = step.host["trainer_step"]
        self.log.record(dict(decision), event_rows(self.trainer.step, decision, self.monitor, estimated,
                                                   applied_s, self.apply_decisions, observed_step=observed),
                        step=observed)
        return None if changes.s4_plan is None else (changes.s4_plan, decision)

    def ring_groups(self) -> dict:
        """Validation's rings this rank is in → their groups (its pipeline: the PP group; its DP
        column: the DP group), whose communicators :meth:`bind_layout` made."""
        pipeline, column = self.grid[self.dp_index], [row[self.pp_index] for row in self.grid]
        return {frozenset(pipeline): self.pp_group, frozenset(column): self.dp_group}

    def view(self) -> JobView:
        """What a decision is applied to (:func:`~titan_ext.runtime.falcon.apply.plan_changes` reads nothing else of the job)."""
        return JobView(step=self.trainer.step, split=tuple(self.split), even_split=tuple(self.even_split),
                       grid=tuple(tuple(r) for r in self.grid),
                       replanning_on=bool(getattr(self.trainer.pp_schedule, "adaptive", False)),
                       checkpoint_enabled=bool(getattr(getattr(self.trainer, "checkpointer", None), "enable", False)),
                       apply_decisions=bool(self.apply_decisions),
                       delegate_after_s3=bool(getattr(self.section, "falcon_delegation", False)),
                       spares=self.spares, device_of=tuple(self.device_of))

    def apply(self, changes: JobChanges) -> dict[str, float | None]:
        """The job's one place of change (§5.3): re-planning on, S2's split, S3 in memory; S4 is
        the caller's, after the record. Returns strategy → measured cost for those applied (S4:
        None, the restarted job measures it)."""
        for level, line in changes.notes:
            getattr(logger, level)(f"[titan_ext] {line}")
        applied_s: dict[str, float | None] = {}
        for strategy in changes.applied:
            t0 = time.perf_counter()
            if strategy == "checkpoint_restart":
                applied_s[strategy] = None
                continue
            if strategy == "ignore":
                applied_s[strategy] = 0.0  # S1
                continue
            self._version += 1  # the steps already run describe what no longer runs
            if strategy == "pipemorph_replan":
                self.trainer.pp_schedule.adaptive = True
            elif strategy == "microbatch_redistribution":
                self.split = list(changes.split)
            elif strategy == "topology_adjustment":
                self._apply_topology([list(r) for r in changes.grid])
            applied_s[strategy] = self.costs.measured[strategy] if strategy == "topology_adjustment" \
                else time.perf_counter() - t0
            logger.info(f"[titan_ext] Falcon applied {strategy} at step {self.trainer.step} (split {self.split}, "
                        f"grid {self.grid})")
        if changes.delegate_links:
            self._version += 1
            self._delegate(changes.delegate_links)
        return applied_s

    def _delegate(self, links) -> None:
        """PipeMorph §7.3 after S3: the moved slow links are PP hops now — re-planning on everywhere
        (PipeMorph adapts the slack of the slow hop) and, on the pipelines holding one, the moved
        link's PP messages through the delegates, the other links direct (every rank of such a
        pipeline alike, at this boundary)."""
        schedule = self.trainer.pp_schedule
        schedule.adaptive = True
        mine = [tuple(k) for k in links if set(k) <= set(self.grid[self.dp_index])]
        if not mine:
            return
        delegation = getattr(schedule, "delegation", None)  # every adaptive schedule's (None: "off")
        if delegation is None:
            logger.warning(f"[titan_ext] Falcon: slow link(s) {mine} moved onto a PP hop; this schedule "
                           f"({type(schedule).__name__}) has no delegates ([titan_ext] delegation = \"off\"): "
                           f"re-planning only")
            return
        delegation.set(True, reason=f"falcon: S3 moved slow link(s) {mine} onto a PP hop", links=mine)
        self.delegated_links = sorted(set(self.delegated_links) | set(mine))
        logger.info(f"[titan_ext] Falcon: pipeline {self.dp_index} delegates the PP messages of slow link(s) {mine}")

    def _apply_topology(self, grid: list[list[int]]) -> None:
        """S3 in memory (:func:`titan_ext.titan.falcon_s3.apply_topology`), then this job's view of
        the layout (:meth:`bind_layout`), the data iterator, the S2 split re-planned for the new
        replicas (:func:`~titan_ext.runtime.falcon.apply.replanned_split`); its measured time becomes S3's cost."""
        from titan_ext.titan.falcon_s3 import apply_topology

        loader = self.trainer.dataloader
        result = apply_topology(self.trainer, self.grid, grid, control_group=self.control)
        self.bind_layout([[int(r) for r in row] for row in grid], result.mesh["dp_replicate"].get_group())
        if self.trainer.dataloader is not loader:
            self.data_iterator = self.trainer.batch_generator(self.trainer.dataloader)
        if self.split != self.even_split:
            self.split = replanned_split(self.monitor, self.even_split)
        self.costs.set_measured("topology_adjustment", result.seconds)
        logger.info(f"[titan_ext] Falcon S3: rank {self.rank} (dp, pp) {result.old_role} -> "
                    f"{result.new_role}, state from rank {result.received_from}, {result.seconds:.3f} s")

    def _observe(self, obs: IterationObservation, trainer_step: int) -> FalconDecision:
        """Feed the monitor (§4.2) from this process's second step on. Its first step is a warm-up
        whose time includes one-off work — S2's cost measured by a real chunk exchange, PipeMorph's
        first plan and profile, first allocations — and is no sample of the healthy iteration time:
        with a fault from step 5 the detector has 3 healthy steps, and a slow first one among them
        delayed the onset (measured on a slow DP link's series: confirmed at step 14 with it, at
        step 10 without). The change point is also reported as a training step."""
        if self._fed_from is None:
            self._fed_from = trainer_step + 1
            return FalconDecision(-1, {"falcon/iteration_time_s": obs.iteration_time_s, "falcon/warmup": 1})
        decision = self.monitor.observe(obs)
        if "falcon/change_point_iteration" in decision:
            decision = decision.with_metrics(
                {"falcon/change_point_step": self._fed_from + decision["falcon/change_point_iteration"]})
        return decision


def _devices(text: str, world: int | None) -> list[int]:
    """``falcon_devices`` / ``falcon_spares``: comma-separated device ids; empty = identity over
    ``world`` ranks."""
    text = text.strip()
    if not text:
        return list(range(world or 0))
    ids = [int(x) for x in text.split(",")]
    if world is not None and len(ids) != world:
        raise ValueError(f"[titan_ext] falcon_devices = {text!r}: {len(ids)} devices for {world} ranks")
    if len(set(ids)) != len(ids):
        raise ValueError(f"[titan_ext] falcon_devices / falcon_spares = {text!r}: a device twice")
    return ids


def _parse(specs: tuple[str, str]) -> tuple:
    device_spec, link_spec = specs
    return parse_slow_device(device_spec), parse_slow_link(link_spec)
