"""Falcon S4 applied in a TorchTitan DP × PP job: checkpoint, exclude the slow device, restart on
the remaining ranks, resume (Falcon §5.1 S4 "Checkpoint-and-restart", §5.2 ski rental
item 2).

Three parts, one per process that takes part:

* **The slow job** (:func:`~titan_ext.runtime.falcon.restart.plan_checkpoint_restart` + :func:`checkpoint_and_exit`, called by :class:`~titan_ext.titan.falcon_job.FalconJob`
  when Alg. 1 reaches S4): TorchTitan's checkpointer saves the full state (model, optimizer, LR
  schedule, train step) at the current step; rank 0 writes the plan
  (:func:`~titan_ext.runtime.falcon.restart.plan_exclusion`: the DP replicas holding the slow
  device are dropped, the global batch is re-split over the rest) with the time the save began;
  every rank then exits with :data:`~titan_ext.runtime.falcon.restart.S4_EXIT_CODE`.
* **The launcher** (:func:`launch`, ``python -m titan_ext.titan.falcon_s4``; ``scripts/launch.sh``
  on SLURM): runs torchrun, and when the job left a pending plan relaunches it on the kept ranks
  with the plan's overrides (DP degree, checkpoint loading without the data loader, emulation
  renumbered, ``CUDA_VISIBLE_DEVICES`` of the kept local devices) -- only from a plan that carries
  the launch id of the run that just ended (:data:`ENV_LAUNCH_ID`) and holds nothing but what the
  planner writes (:func:`pending_plan`). SIGTERM / SIGINT to the launcher end the job's whole
  process group (exit 143 / 130).
* **The restarted job** (:class:`S4Resume`): TorchTitan loads the checkpoint and continues at the
  next step; on its first step the S4 cost is measured (save begin → first step of the new job:
  save + exit + relaunch + start-up + load) and recorded as a ``falcon_events.jsonl`` row, and in
  ``falcon_costs.json``, from which the next DP × PP job of this dump folder takes its S4 cost
  (:func:`recorded_s4_cost`). After :data:`OUTCOME_STEPS` steps an "outcome" row compares the
  iteration time with the one before S4.

S4 as Falcon §5.1 runs it ("performs checkpointing and restarts training on healthy nodes"): the
same grid and DP on healthy devices, whenever there is somewhere to restart --

* spare devices (``[titan_ext] falcon_spares``): a
  :class:`~titan_ext.runtime.falcon.restart.ReplacePlan`, the slow device's rank restarts on a spare;
* else spare nodes of the launcher (:data:`~titan_ext.runtime.falcon.restart.ENV_SPARE_NODES`, exported by ``scripts/launch.sh`` under
  SLURM: the allocation's nodes beyond the job's): a :class:`~titan_ext.runtime.falcon.restart.NodeReplacePlan`
  (:func:`~titan_ext.runtime.falcon.restart.plan_node_replacement`), every rank of the slow device's node restarts on a spare node, which
  the relaunch reaches with ``srun --exclude=<slow node>`` and the same node count.

Only without either it is the shrink (:func:`~titan_ext.runtime.falcon.restart.plan_exclusion`): the
restarted world is smaller and the healthy peers of the slow device in its replica idle; the plan
then carries ``shrink_reason`` (why no spare path), which the S4 exit logs and the restart row records.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titan_ext.runtime.falcon import device_clock
from titan_ext.runtime.falcon.restart import (
    S4_EXIT_CODE,
    S4_PLAN_FILE,
    NodeReplacePlan,
    read_s4_plan,
    relaunch_overrides,
    remap_emulation,
    write_s4_plan,
    ReplacePlan,
)

__all__ = ["checkpoint_and_exit", "relaunch_spec", "estimate_s4_cost", "S4Resume", "recorded_s4_cost", "launch",
           "ENV_S4_PLAN", "ENV_LAUNCH_ID", "OUTCOME_STEPS", "PlanRefused", "pending_plan", "consume_plan"]

ENV_S4_PLAN = "TITAN_EXT_S4_PLAN"
"""Set by the launcher in the restarted job: the path of the plan it was restarted from."""
ENV_LAUNCH_ID = "TITAN_EXT_LAUNCH_ID"
"""Set by the launchers (:func:`launch`, scripts/launch.sh) for each run of the job, a new value for each
relaunch: :func:`checkpoint_and_exit` writes it into the plan, and a launcher relaunches only from a
pending plan that carries the id of the run that just ended (a plan left by an earlier run is refused)."""
COSTS_FILE = "falcon_costs.json"
OUTCOME_STEPS = 5
"""Steps after the restart whose median iteration time is the S4 outcome's "after"."""
_EMULATION_ENV = ("TITAN_EXT_SLOW_DEVICE", "TITAN_EXT_SLOW_LINK")


def _save_checkpoint(trainer: Any, step: int) -> None:
    """TorchTitan's full checkpoint of ``step`` (not its model-only last-step save) now."""
    ckpt = trainer.checkpointer
    interval = ckpt.interval
    ckpt.interval = 1  # save() writes on step % interval == 0: this step, whatever the interval
    try:
        ckpt.save(step, last_step=False)
    finally:
        ckpt.interval = interval
    # async checkpointing: the files (and their manifest, checkpoint_guard.py) must be complete before
    # this process exits: 0.3's maybe_wait_for_saving, 0.2's _async_wait
    wait = getattr(ckpt, "maybe_wait_for_saving", None) or getattr(ckpt, "_async_wait", None)
    if callable(wait):
        wait()


def checkpoint_and_exit(job: Any, plan, decision: dict) -> None:
    """S4 applied: save, write the plan (rank 0), leave with S4_EXIT_CODE on every rank."""
    trainer, step = job.trainer, job.trainer.step
    where: list = [None] * dist.get_world_size()
    dist.all_gather_object(where, (socket.gethostname(), int(os.environ.get("LOCAL_RANK", "0")),
                                   torch.device(job.device).type), group=job.control)
    begin = time.time()
    _save_checkpoint(trainer, step)
    save_s = torch.tensor([time.time() - begin], dtype=torch.float64)
    dist.all_reduce(save_s, op=dist.ReduceOp.MAX, group=job.control)
    if job.rank == 0:
        from titan_ext.runtime.falcon.files import emulation_specs

        emulation = remap_emulation(plan, *emulation_specs(job.section))
        from titan_ext.titan.adapters import current

        adapter = current()
        write_s4_plan(Path(adapter.trainer_dump_folder(trainer)), plan, status="pending",
                      begin_time=begin, save_s=float(save_s),
                      estimated_cost_s=job.monitor.config.costs.of("checkpoint_restart"),
                      iteration_time_before_s=decision.get("falcon/iteration_time_s"),
                      overrides=relaunch_overrides(plan, emulation,
                                                   adapter.trainer_training(trainer).local_batch_size),
                      hosts=[where[r][0] for r in plan.kept_ranks],
                      local_devices=_local_devices(plan, where),
                      device_type=where[0][2], launch_id=os.environ.get(ENV_LAUNCH_ID),
                      **_mode_fields(plan, where))
    dist.barrier(group=job.control)
    if job.rank == 0:
        from torchtitan.tools.logging import logger

        logger.warning(f"[titan_ext] Falcon S4: checkpointed step {step} ({float(save_s):.2f} s); exiting "
                       f"with status {S4_EXIT_CODE} for a relaunch on ranks {plan.kept_ranks} without "
                       f"devices {plan.excluded}, {_describe(plan)} (python -m titan_ext.titan.falcon_s4 or "
                       f"scripts/launch.sh relaunch; a plain torchrun stops here)")
    trainer.close()
    dist.destroy_process_group()
    raise SystemExit(S4_EXIT_CODE)


def _mode_fields(plan, where: list) -> dict:
    """The plan file's fields of its kind: a node replacement's mode and excluded hosts, a shrink's reason."""
    if isinstance(plan, NodeReplacePlan):
        return {"mode": "replace_nodes", "excluded_nodes": plan.excluded_nodes,
                "excluded_hosts": sorted({where[r][0] for r in range(len(where))
                                          if r // plan.ranks_per_node in plan.excluded_nodes})}
    if not isinstance(plan, ReplacePlan):
        return {"shrink_reason": getattr(plan, "shrink_reason", "")}
    return {}


def _describe(plan) -> str:
    """One phrase for the log: where the job restarts."""
    if isinstance(plan, NodeReplacePlan):
        return f"node(s) {plan.excluded_nodes} replaced by spare node(s), DP {plan.num_dp} kept"
    if isinstance(plan, ReplacePlan):
        return f"onto spare device(s) {plan.replaced}, DP {plan.num_dp} kept"
    return f"shrinking DP to {plan.num_dp} (no spare: {getattr(plan, 'shrink_reason', '')})"


def _local_devices(plan, where: list) -> list[int]:
    """The local device of each new rank: its old rank's, or for a rank moved onto a spare device the
    spare (on GPUs a local CUDA index); onto a spare node the same local index there."""
    out = []
    for i, r in enumerate(plan.kept_ranks):
        moved = isinstance(plan, ReplacePlan) and not isinstance(plan, NodeReplacePlan) and r in plan.excluded
        out.append(int(plan.devices[i]) if moved else int(where[r][1]))
    return out


def estimate_s4_cost(job: Any, dump_folder) -> float:
    """S4's ski-rental cost before any restart measured it (slowest rank's): this process's start-up
    (interpreter, rendezvous, model build: process start → now, /proc) plus saving and loading its
    stage's state (the model and AdamW's two moments, 3x the parameters) to and from the dump
    folder — what a relaunch repeats (timed on at most ~64 MB of it, scaled to its size). A cost
    measured by an earlier restart of this dump folder's job (:func:`recorded_s4_cost`) replaces
    it."""
    recorded = recorded_s4_cost(dump_folder)
    mine = torch.tensor([recorded if recorded is not None else _restart_estimate_s(job, dump_folder)],
                        dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=job.control)  # every rank, whatever it read
    return float(mine)


def _restart_estimate_s(job: Any, dump_folder) -> float:
    params = [p.detach() for m in job.trainer.model_parts for p in m.parameters()]
    total = 3 * sum(p.numel() * p.element_size() for p in params)
    sample, nbytes = [], 0
    for p in params:  # at most PROBE_BYTES (64 MB) written here; the time is scaled to the whole state
        if nbytes + p.numel() * p.element_size() > device_clock.PROBE_BYTES:
            if not sample:  # a parameter larger than the probe: its first PROBE_BYTES
                flat = p.reshape(-1)
                sample.append(flat[:device_clock.probe_numel(flat.numel(), flat.element_size())].to("cpu", copy=True))
                nbytes = sample[0].numel() * sample[0].element_size()
            break
        sample.append(p.cpu())
        nbytes += p.numel() * p.element_size()
    path = Path(dump_folder) / f".falcon_s4_probe_rank{dist.get_rank()}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    torch.save(sample, path)
    torch.load(path, weights_only=True)
    save_load_s = (time.perf_counter() - t0) * total / max(nbytes, 1)
    path.unlink(missing_ok=True)
    return time.time() - _process_start_time() + save_load_s


def _process_start_time() -> float:
    """This process's start (epoch seconds), from /proc (Linux)."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return boot + start_ticks / os.sysconf("SC_CLK_TCK")


def recorded_s4_cost(dump_folder) -> float | None:
    """The S4 cost measured by an earlier restart of this dump folder's job, if any."""
    path = Path(dump_folder) / COSTS_FILE
    if not path.exists():
        return None
    return json.loads(path.read_text()).get("checkpoint_restart")


class S4Resume:
    """In a job the launcher restarted after S4: measure and record the S4 cost and outcome.

    Its times are host data: they are reduced on ``control``, a gloo control group
    (:func:`~titan_ext.runtime.falcon.device_clock.control_group`), never on the default group — on a
    GPU job that is NCCL, which takes device tensors only (DESIGN.md "GPU rules")."""

    def __init__(self, plan: dict, dump_folder: Path, rank: int, trainer: Any = None, control: Any = None,
                 every: int = 1, last_step: int | None = None):
        """``every``: steps whose times are reduced together (one all-reduce every ``every`` steps and at
        ``last_step``: the job's ``falcon_check_every``, its ``training.steps``)."""
        self.plan, self.dump, self.rank, self.trainer = plan, Path(dump_folder), rank, trainer
        self.every, self.last_step = max(1, int(every)), last_step
        self._pending: list[tuple[int, float]] = []
        if control is None:
            from titan_ext.runtime.falcon.device_clock import control_group

            control = control_group()  # collective: every rank of the restarted job makes it
        self.control = control
        self.times: list[float] = []
        self.measured_s: float | None = None

    @classmethod
    def from_env(cls, trainer: Any, check_every: int = 1) -> S4Resume | None:
        """The restarted job's resume (None: not a restart); ``check_every``: the job's
        ``[titan_ext] falcon_check_every``."""
        plan = resume_plan_from_env()
        if plan is None:
            return None
        from titan_ext.titan.adapters import current
        from titan_ext.titan.adapters import last_training_step

        return cls(plan, Path(current().trainer_dump_folder(trainer)), dist.get_rank(), trainer,
                   every=check_every, last_step=last_training_step(trainer))

    def before_step(self, step: int) -> None:
        """The first step of the restarted job: the S4 cost is the time since the save began."""
        if self.measured_s is not None:
            return
        mine = torch.tensor([time.time() - float(self.plan["begin_time"])], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.control)
        self.measured_s = float(mine)
        self._record({"kind": "restart", "iteration": step, "strategy": "S4", "name": "checkpoint_restart",
                      "applied": True, "from_step": self.plan["step"], "excluded": self.plan["excluded"],
                      "world_size": self.plan["world_size"], "num_dp": self.plan["num_dp"],
                      "chunks_per_replica": self.plan["chunks_per_replica"],
                      "estimated_cost_s": self.plan["estimated_cost_s"], "measured_cost_s": self.measured_s,
                      "save_s": self.plan["save_s"],
                      "restart_and_load_s": self.measured_s - float(self.plan["save_s"]),
                      "mode": self.plan.get("mode", "shrink"), "devices": self.plan.get("devices"),
                      **({"shrink_reason": self.plan["shrink_reason"]} if "shrink_reason" in self.plan else {})})
        if self.rank == 0:
            (self.dump / COSTS_FILE).write_text(json.dumps({"checkpoint_restart": self.measured_s}))
        # the restarted job's own Falcon (the schedule's monitor in a PP-only job) uses it from now on
        monitor = getattr(getattr(self.trainer, "pp_schedule", None), "falcon", None)
        if monitor is not None:
            import dataclasses

            monitor.config.costs = dataclasses.replace(monitor.config.costs, checkpoint_restart=self.measured_s)
            monitor.planner.costs = monitor.config.costs

    def after_step(self, step: int, step_s: float) -> None:
        """The step's iteration time (max over ranks, as the DP x PP job's Falcon measures it) into
        ``falcon.jsonl``, reduced with the other steps since the last reduction every ``every``
        steps and at the last step (one all-reduce of host data a check, as the job's Falcon);
        after OUTCOME_STEPS steps the outcome row."""
        self._pending.append((step, step_s))
        if len(self._pending) < self.every and not (self.last_step is not None and step >= self.last_step):
            return
        t = torch.tensor([s for _, s in self._pending], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        steps, self._pending = [k for k, _ in self._pending], []
        for k, slowest in zip(steps, (float(x) for x in t)):  # a host tensor (made above, no device)
            self._after_step(k, slowest)

    def _after_step(self, step: int, slowest_s: float) -> None:
        self.times.append(slowest_s)
        if self.rank == 0:
            from titan_ext.runtime.falcon.files import FALCON_LOG

            with open(self.dump / FALCON_LOG, "a") as f:
                f.write(json.dumps({"step": step, "falcon/iteration_time_s": slowest_s,
                                    "falcon/after_s4_from_step": self.plan["step"]}) + "\n")
        if len(self.times) == OUTCOME_STEPS:
            self._record({"kind": "outcome", "iteration": step, "strategy": "S4", "name": "checkpoint_restart",
                          "iteration_time_before_s": self.plan["iteration_time_before_s"],
                          "iteration_time_after_s": statistics.median(self.times)})

    def _record(self, row: dict) -> None:
        if self.rank != 0:
            return
        from torchtitan.tools.logging import logger

        from titan_ext.runtime.falcon.files import FALCON_EVENTS

        with open(self.dump / FALCON_EVENTS, "a") as f:
            f.write(json.dumps(row) + "\n")
        logger.info(f"[titan_ext] Falcon S4 {row['kind']} at step {row['iteration']}: "
                    + ", ".join(f"{k} {v}" for k, v in row.items() if k.endswith("_s")))
        from titan_ext.titan.metrics import _wandb_loggers, log_tagged

        processor = getattr(self.trainer, "metrics_processor", None)
        for wb in _wandb_loggers(processor) if processor is not None else []:
            log_tagged(wb, {f"falcon/s4_{row['kind']}/{k}": v for k, v in row.items()
                            if isinstance(v, (int, float)) and not isinstance(v, bool)}, step=row["iteration"])


# ---------------------------------------------------------------------------- the launcher
STOP_GRACE_S = 30.0
"""After SIGTERM / SIGINT to :func:`launch`: the seconds the job's processes have to end before SIGKILL."""
RELAUNCH_STATUSES = (S4_EXIT_CODE, 1)
"""torchrun's exit status after an S4 exit: the ranks' S4_EXIT_CODE, which torchrun reports as 1 (its
status for any failed worker; the plan's launch id says that the failure was this run's S4 exit)."""


class PlanRefused(Exception):
    """A pending S4 plan that no launcher relaunches from (the message names the file and the reason)."""


def _int_value(text: str) -> bool:
    return re.fullmatch(r"[1-9][0-9]{0,9}", text) is not None


def _emulation_value(parse):
    def check(text: str) -> bool:
        from titan_ext.runtime.falcon.emulation import EmulationSpecError

        if re.fullmatch(r"([0-9][0-9A-Za-z.:@+ -]*)?", text) is None:
            return False
        try:
            parse(text)
        except (EmulationSpecError, ValueError):
            return False
        return True
    return check


def _device_list_value(text: str) -> bool:
    return re.fullmatch(r"([0-9]{1,6}(,[0-9]{1,6})*)?", text) is not None


def _plan_overrides():
    """relaunch_overrides' arguments: key -> check of its value (None: a flag without one)."""
    from titan_ext.runtime.falcon.emulation import parse_slow_device, parse_slow_link

    return {"--parallelism.data_parallel_replicate_degree": _int_value,
            "--training.global_batch_size": _int_value,
            "--checkpoint.enable": None,
            "--checkpoint.exclude_from_loading": lambda text: text == "dataloader",
            "--titan_ext.emulate_slow_device": _emulation_value(parse_slow_device),
            "--titan_ext.emulate_slow_link": _emulation_value(parse_slow_link),
            "--titan_ext.falcon_devices": _device_list_value,
            "--titan_ext.falcon_spares": _device_list_value}


def _override_error(overrides) -> str | None:
    """Why ``overrides`` is not what :func:`~titan_ext.runtime.falcon.restart.relaunch_overrides` writes
    (its keys, each at most once, each with a value of its kind), or None."""
    if not isinstance(overrides, list) or not all(isinstance(x, str) for x in overrides):
        return "its overrides are not a list of strings"
    known, seen, i = _plan_overrides(), set(), 0
    while i < len(overrides):
        key = overrides[i]
        if key not in known:
            return f"override {key!r} is not one the S4 planner writes"
        if key in seen:
            return f"override {key} appears twice"
        seen.add(key)
        i += 1
        check = known[key]
        if check is None:
            continue
        if i == len(overrides) or not check(overrides[i]):
            value = repr(overrides[i]) if i < len(overrides) else "(none)"
            return f"override {key} has the value {value}, not one the S4 planner writes"
        i += 1
    return None


#: what :class:`S4Resume` reads of the plan it was restarted from: numbers, and numbers or null
_RESUME_FIELDS = ("begin_time", "step", "world_size", "num_dp", "chunks_per_replica", "save_s")
_RESUME_OPTIONAL = ("estimated_cost_s", "iteration_time_before_s")


def resume_plan_from_env(environ=os.environ) -> dict | None:
    """The plan of :data:`ENV_S4_PLAN` (None when unset), checked before any process group: a regular
    JSON file of at most 1 MiB holding an object with :data:`_RESUME_FIELDS` as numbers,
    :data:`_RESUME_OPTIONAL` as numbers or null and ``excluded`` as a list (what
    :func:`checkpoint_and_exit` writes). ValueError naming the variable otherwise."""
    from titan_ext.args import read_input_text

    path = environ.get(ENV_S4_PLAN, "").strip()
    if not path:
        return None
    label = f"{ENV_S4_PLAN} = {path!r}"
    text = read_input_text(path, 1 << 20, label, "JSON")
    try:
        plan = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{label}: not JSON ({e})") from None
    if not isinstance(plan, dict):
        raise ValueError(f"{label}: not an S4 plan (a JSON object written by a job's S4 exit)")
    bad = [k for k in _RESUME_FIELDS if type(plan.get(k)) not in (int, float) or plan[k] != plan[k]]
    bad += [k for k in _RESUME_OPTIONAL if type(plan.get(k, 0)) not in (int, float, type(None))]
    if not isinstance(plan.get("excluded"), list):
        bad.append("excluded")
    if bad:
        raise ValueError(f"{label}: not an S4 plan of this version: {', '.join(bad)} missing or of the wrong type")
    return plan


def _plan_error(plan: dict) -> str | None:
    """Why the fields a launcher uses are not what :func:`checkpoint_and_exit` writes, or None."""
    error = _override_error(plan.get("overrides", []))
    if error:
        return error
    ints = lambda v: isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)  # noqa: E731
    if "world_size" in plan and not (type(plan["world_size"]) is int and plan["world_size"] >= 1):
        return f"world_size {plan['world_size']!r} is not a positive integer"
    if "local_devices" in plan and not ints(plan["local_devices"]):
        return "local_devices is not a list of device indices"
    if "hosts" in plan and not (isinstance(plan["hosts"], list)
                                and all(isinstance(h, str) and h for h in plan["hosts"])):
        return "hosts is not a list of host names"
    if "hosts" in plan and "local_devices" in plan and len(plan["hosts"]) != len(plan["local_devices"]):
        return "hosts and local_devices differ in length"
    if not isinstance(plan.get("device_type", "cpu"), str):
        return "device_type is not a string"
    if plan.get("mode", "shrink") not in ("shrink", "replace", "replace_nodes"):
        return f"mode {plan.get('mode')!r} is not one the S4 planner writes"
    if "excluded_hosts" in plan and not (isinstance(plan["excluded_hosts"], list)
                                         and all(isinstance(h, str) and h for h in plan["excluded_hosts"])):
        return "excluded_hosts is not a list of host names"
    return None


def pending_plan(dump, launch_id: str | None = None) -> dict | None:
    """The pending S4 plan of ``dump``, checked, or None when there is none (no file, or its plan is not
    pending). :class:`PlanRefused` for a plan not written under ``launch_id`` (default: this process's
    ``TITAN_EXT_LAUNCH_ID``) or holding anything the S4 planner does not write."""
    path = Path(dump) / S4_PLAN_FILE
    try:
        plan = read_s4_plan(dump)
    except (OSError, ValueError) as e:
        raise PlanRefused(f"{path}: cannot read the S4 plan ({e}); not relaunching from it") from None
    if plan is None or not isinstance(plan, dict) or plan.get("status") != "pending":
        return None
    expected = os.environ.get(ENV_LAUNCH_ID) if launch_id is None else launch_id
    if plan.get("launch_id") != expected:
        raise PlanRefused(f"{path}: its launch_id {plan.get('launch_id')!r} is not the run's that just ended "
                          f"({expected!r}); not relaunching from a plan of another run")
    error = _plan_error(plan)
    if error:
        raise PlanRefused(f"{path}: {error}; not relaunching from it")
    return plan


def _mark_consumed(dump, plan: dict) -> None:
    """The plan, applied, is marked consumed (one S4 exit restarts once)."""
    path = Path(dump) / S4_PLAN_FILE
    tmp = path.with_name(f".{S4_PLAN_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**plan, "status": "consumed"}, indent=1))
    os.replace(tmp, path)


def consume_plan(dump, launch_id: str | None = None) -> dict | None:
    """:func:`pending_plan` of ``dump``, marked consumed once checked (so one exit restarts once), or None."""
    plan = pending_plan(dump, launch_id)
    if plan is not None:
        _mark_consumed(dump, plan)
    return plan


def _dump_folder(train_args: list[str]) -> str | None:
    """The last ``--job.dump_folder`` of the training arguments (the one TorchTitan takes), or None."""
    found = None
    for i, arg in enumerate(train_args):
        key, sep, value = arg.partition("=")
        if key in ("--job.dump_folder", "--job.dump-folder"):
            found = value if sep else (train_args[i + 1] if i + 1 < len(train_args) else "")
    return found


def relaunch_env(plan: dict, env: dict[str, str]) -> dict[str, str]:
    """The restarted job's environment: the plan's path, no emulation from the environment (the plan
    carries it, renumbered), and on GPUs only the kept local devices visible."""
    env = {k: v for k, v in env.items() if k not in _EMULATION_ENV}
    if plan.get("mode") == "replace_nodes":
        raise SystemExit("falcon.s4 launch: a restart onto spare nodes is scripts/launch.sh's (SLURM: srun --exclude)")
    if plan.get("device_type") == "cuda":
        if len(set(plan["hosts"])) > 1:
            raise SystemExit("falcon.s4 launch: a multi-node S4 restart is scripts/launch.sh's (SLURM)")
        visible = env.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(max(plan["local_devices"], default=-1) + 1)]
        if max(plan["local_devices"], default=-1) >= len(ids):
            raise SystemExit(f"falcon.s4 launch: the plan's local devices {plan['local_devices']} are not all "
                             f"in CUDA_VISIBLE_DEVICES={visible}")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[i] for i in plan["local_devices"])
    return env


def relaunch_spec(plan: dict, hosts: list[str]) -> dict:
    """What a multi-node launcher (scripts/launch.sh) runs after S4: the nodes of ``hosts`` (the
    allocation) that keep ranks, the same number on each (else SystemExit: torchrun starts as many
    ranks on every node), the nodes to exclude, and per kept node its visible devices. Which rank a
    kept device gets does not matter: every device left is healthy, and each new rank loads its
    stage from the checkpoint."""
    short = lambda h: h.split(".")[0]  # noqa: E731 (SLURM lists short names; gethostname may not)
    if plan.get("mode") == "replace_nodes":
        return _node_replacement_spec(plan, hosts, short)
    kept = {h: [d for hh, d in zip(plan["hosts"], plan["local_devices"]) if short(hh) == short(h)]
            for h in hosts}
    kept = {h: sorted(ds) for h, ds in kept.items() if ds}
    counts = {len(ds) for ds in kept.values()}
    if len(counts) != 1:
        raise SystemExit(f"falcon.s4: the kept ranks are uneven over the nodes ({kept}); "
                         f"torchrun needs the same number on every node")
    return {"nnodes": len(kept), "nproc_per_node": counts.pop(),
            "exclude": [h for h in hosts if h not in kept], "devices": kept,
            "overrides": plan.get("overrides", []), "device_type": plan.get("device_type", "cpu")}


def _node_replacement_spec(plan: dict, hosts: list[str], short) -> dict:
    """:func:`relaunch_spec` of a :class:`NodeReplacePlan`: the same node count and ranks per node, the
    slow node(s) excluded (srun then takes a spare node of the allocation ``hosts`` in its place), every
    node not excluded with the job's local devices."""
    used = list(dict.fromkeys(short(h) for h in plan["hosts"]))
    slow = {short(h) for h in plan.get("excluded_hosts", [])}
    if not slow:
        raise SystemExit("falcon.s4: a node replacement plan without excluded_hosts")
    free = [h for h in hosts if short(h) not in slow]
    if len(free) < len(used):
        raise SystemExit(f"falcon.s4: {len(used)} node(s) needed, {len(free)} left in the allocation "
                         f"{hosts} without {sorted(slow)}")
    if len(plan["local_devices"]) % len(used):
        raise SystemExit(f"falcon.s4: {len(plan['local_devices'])} ranks are not whole nodes of {len(used)}")
    local = sorted(set(plan["local_devices"]))
    return {"nnodes": len(used), "nproc_per_node": len(plan["local_devices"]) // len(used),
            "exclude": [h for h in hosts if short(h) in slow], "devices": {h: local for h in free},
            "spare_nodes": len(free) - len(used), "overrides": plan.get("overrides", []),
            "device_type": plan.get("device_type", "cpu")}


def _print_relaunch_spec(argv: list[str]) -> int:
    """``python -m titan_ext.titan.falcon_s4 relaunch-spec DUMP HOST...``: DUMP's pending plan, written
    under this process's TITAN_EXT_LAUNCH_ID (the run that just ended), as shell assignments (S4_NNODES,
    S4_NPROC_PER_NODE, S4_EXCLUDE, S4_ARGS, S4_PLAN, S4_DEVICES_<i> per host in the order given), then
    marked consumed; exit 1 when there is no pending plan or it is refused (one line on stderr), 2 on
    a usage error."""
    import shlex

    if len(argv) < 2 or any(not a.strip() for a in argv):
        print("error: usage: python -m titan_ext.titan.falcon_s4 relaunch-spec DUMP HOST...", file=sys.stderr)
        return 2
    dump, hosts = Path(argv[0]), argv[1:]
    try:
        plan = pending_plan(dump)
    except PlanRefused as e:
        print(f"falcon.s4: {e}", file=sys.stderr)
        return 1
    if plan is None:
        return 1
    if "hosts" not in plan or "local_devices" not in plan:
        print(f"falcon.s4: {dump / S4_PLAN_FILE}: no hosts / local_devices; not relaunching from it", file=sys.stderr)
        return 1
    spec = relaunch_spec(plan, hosts)
    lines = [f"S4_NNODES={spec['nnodes']}", f"S4_NPROC_PER_NODE={spec['nproc_per_node']}",
             f"S4_EXCLUDE={shlex.quote(','.join(spec['exclude']))}",
             f"S4_ARGS={shlex.quote(shlex.join(spec['overrides']))}",
             f"S4_PLAN={shlex.quote(str(dump / S4_PLAN_FILE))}"]
    if "spare_nodes" in spec:  # a node replacement used spare node(s): the restarted job has fewer
        lines.append(f"S4_SPARE_NODES={int(spec['spare_nodes'])}")
    for i, host in enumerate(hosts):
        lines.append(f"S4_DEVICES_{i}={shlex.quote(','.join(str(d) for d in spec['devices'].get(host, [])))}")
    print("\n".join(lines), flush=True)
    _mark_consumed(dump, plan)
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (not argparse's usage block)
        print(f"error: {self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)


def _int_in(low: int, high: int):
    def parse(text: str) -> int:
        try:
            value = int(text) if text.isascii() else None
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer in [{low}, {high}], got {text!r}")
        return value
    return parse


def _path_problem(path: Path, kind: str) -> str | None:
    """Why ``path`` cannot be used as a ``kind`` ("directory" or "file"): the path or its nearest existing
    parent is of the wrong kind; None when it can."""
    if path.exists():
        if kind == "directory" and not path.is_dir():
            return "is not a directory"
        if kind == "file" and path.is_dir():
            return "is a directory"
        if kind == "file" and not os.access(path, os.W_OK):
            return "is not writable"
        return None
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        return f"cannot be made: {parent} is not a directory"
    if kind == "file" and not path.absolute().parent.is_dir():
        return f"cannot be made: its directory {path.absolute().parent} does not exist"
    if kind == "file" and not os.access(path.absolute().parent, os.W_OK):
        return f"cannot be made: its directory {path.absolute().parent} is not writable"
    return None


def _torchrun(nproc: int, port: int, train_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "titan_ext.train", *train_args]


def _alive(pgid: int) -> bool:
    """Whether a process of the process group ``pgid`` still runs (a zombie does not: where PID 1 does not
    reap, e.g. in some containers, the zombies of ranks orphaned by torchrun's end stay in the group)."""
    try:
        names = [n for n in os.listdir("/proc") if n.isdigit()]
    except OSError:  # no procfs
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    for name in names:
        try:
            with open(f"/proc/{name}/stat") as f:
                state, _ppid, group = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue
        if int(group) == pgid and state != "Z":
            return True
    return False


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


class _Jobs:
    """Runs each torchrun of :func:`launch` in a session of its own. SIGTERM / SIGINT to the launcher
    (while this is entered, in the main thread) goes to the running job's whole process group
    (torchrun and its ranks); what is left of it after :data:`STOP_GRACE_S` gets SIGKILL, and
    :attr:`signum` says that the launcher is to exit 128 + it (as srun does)."""

    def __init__(self, grace_s: float):
        self.grace_s, self.signum, self.since = grace_s, None, 0.0
        self.proc: subprocess.Popen | None = None
        self._previous: dict = {}

    def __enter__(self) -> _Jobs:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _on_signal(self, signum, frame) -> None:
        if self.signum is None:
            self.signum, self.since = signum, time.monotonic()
        if self.proc is not None:
            _signal_group(self.proc.pid, signum)

    def run(self, cmd: list[str], env: dict[str, str], log: str) -> int | None:
        """The job's exit status, or None when a signal stopped it (or came before it started)."""
        if self.signum is not None:
            return None
        out = open(log, "a") if log else None
        try:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                         start_new_session=True)
            if self.signum is not None:  # it came while the job started
                _signal_group(self.proc.pid, self.signum)
            while True:
                try:
                    rc = self.proc.wait(timeout=1.0 if self.signum is None else 0.1)
                except subprocess.TimeoutExpired:
                    rc = None
                if self.signum is None:
                    if rc is not None:
                        return rc
                elif rc is not None and not _alive(self.proc.pid):
                    return None
                elif time.monotonic() - self.since > self.grace_s:
                    _signal_group(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
                    return None
                elif rc is not None:  # torchrun has ended, some of its processes not yet
                    time.sleep(0.1)
        finally:
            self.proc = None
            if out is not None:
                out.close()


def _parse_launch(argv: list[str] | None, prog: str | None):
    p = _Parser(prog=prog or "python -m titan_ext.titan.falcon_s4", description=launch.__doc__,
                allow_abbrev=False)
    p.add_argument("--nproc-per-node", type=_int_in(1, 1024), required=True)
    p.add_argument("--master-port", type=_int_in(1, 65535), default=29500)
    p.add_argument("--max-s4", type=_int_in(0, 100), default=1, help="restarts allowed (default 1)")
    p.add_argument("--log", default="", help="append every run's output to this file")
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    train_args = [x for x in a.train_args if x != "--"] if a.train_args[:1] == ["--"] else a.train_args
    if a.master_port + a.max_s4 > 65535:
        p.error(f"argument --master-port: {a.master_port} + --max-s4 {a.max_s4} relaunches (one port each) "
                f"passes 65535")
    if a.log:
        problem = _path_problem(Path(a.log), "file")
        if problem:
            p.error(f"argument --log: {a.log} {problem}")
    folder = _dump_folder(train_args)
    if folder is None or not folder.strip():
        p.error("pass --job.dump_folder DIR among the training arguments (the S4 plan is written there)")
    dump = Path(folder)
    problem = _path_problem(dump, "directory")
    if problem:
        p.error(f"argument --job.dump_folder: {dump} {problem}")
    return a, train_args, dump


def launch(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``python -m titan_ext.titan.falcon_s4 --nproc-per-node 4 [--max-s4 1] -- <titan_ext.train args>``:
    torchrun; after an S4 exit, torchrun again on the plan's world with its overrides. SIGTERM / SIGINT
    end the running job (its whole process group) and exit 143 / 130."""
    a, train_args, dump = _parse_launch(argv, prog)
    (dump / S4_PLAN_FILE).unlink(missing_ok=True)
    run_id = f"{socket.gethostname()}.{os.getpid()}.{time.time_ns()}"
    nproc, extra, env, port = a.nproc_per_node, [], dict(os.environ), a.master_port
    with _Jobs(STOP_GRACE_S) as jobs:
        for attempt in range(a.max_s4 + 1):
            launch_id = f"{run_id}.{attempt}"
            rc = jobs.run(_torchrun(nproc, port, [*train_args, *extra]), env | {ENV_LAUNCH_ID: launch_id}, a.log)
            if rc is None:
                name = signal.Signals(jobs.signum).name
                print(f"falcon.s4: stopped by {name}; the job's processes have ended", file=sys.stderr, flush=True)
                return 128 + jobs.signum
            if rc not in RELAUNCH_STATUSES or attempt == a.max_s4:
                return rc
            try:
                plan = pending_plan(dump, launch_id)
                if plan is not None and "world_size" not in plan:
                    raise PlanRefused(f"{dump / S4_PLAN_FILE}: no world_size; not relaunching from it")
            except PlanRefused as e:
                print(f"falcon.s4: {e}", file=sys.stderr, flush=True)
                return rc
            if plan is None:
                return rc
            new_env = relaunch_env(plan, env) | {ENV_S4_PLAN: str(dump / S4_PLAN_FILE)}
            _mark_consumed(dump, plan)
            print(f"[falcon.s4] S4 at step {plan.get('step')}: excluding devices {plan.get('excluded')}, "
                  f"relaunching on {plan['world_size']} ranks (DP {plan.get('num_dp')} x PP {plan.get('num_pp')})",
                  flush=True)
            nproc, extra, port, env = plan["world_size"], plan.get("overrides", []), port + 1, new_env
    return rc


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``titan-ext falcon-s4`` / ``python -m titan_ext.titan.falcon_s4``: :func:`launch`, or
    ``relaunch-spec DUMP HOST...`` (what scripts/launch.sh reads after an S4 exit)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["relaunch-spec"]:
        return _print_relaunch_spec(argv[1:])
    return launch(argv, prog=prog)


if __name__ == "__main__":
    sys.exit(main())
