"""Falcon S4 applied in a TorchTitan DP × PP job: checkpoint, exclude the slow device, restart on
the remaining ranks, resume (Falcon §5.1 S4 "Checkpoint-and-restart", §5.2 ski rental
item 2).

Three parts, one per process that takes part:

* **The slow job** (:func:`plan_checkpoint_restart` + :func:`checkpoint_and_exit`, called by :class:`~.job.FalconJob`
  when Alg. 1 reaches S4): TorchTitan's checkpointer saves the full state (model, optimizer, LR
  schedule, train step) at the current step; rank 0 writes the plan
  (:func:`~titan_ext.runtime.falcon.restart.plan_exclusion`: the DP replicas holding the slow
  device are dropped, the global batch is re-split over the rest) with the time the save began;
  every rank then exits with :data:`~titan_ext.runtime.falcon.restart.S4_EXIT_CODE`.
* **The launcher** (:func:`launch`, ``python -m titan_ext.titan.falcon.s4``; ``scripts/launch.sh``
  on SLURM): runs torchrun, and when the job left a pending plan relaunches it on the kept ranks
  with the plan's overrides (DP degree, checkpoint loading without the data loader, emulation
  renumbered, ``CUDA_VISIBLE_DEVICES`` of the kept local devices).
* **The restarted job** (:class:`S4Resume`): TorchTitan loads the checkpoint and continues at the
  next step; on its first step the S4 cost is measured (save begin → first step of the new job:
  save + exit + relaunch + start-up + load) and recorded as a ``falcon_events.jsonl`` row, and in
  ``falcon_costs.json``, from which the next DP × PP job of this dump folder takes its S4 cost
  (:func:`recorded_s4_cost`). After :data:`OUTCOME_STEPS` steps an "outcome" row compares the
  iteration time with the one before S4.

With spare devices (``[titan_ext] falcon_spares``) the plan is a
:class:`~titan_ext.runtime.falcon.restart.ReplacePlan`: Falcon's S4, the slow device's rank restarts
on a spare, the grid and DP stay. Without enough spares it is the shrink: the restarted world is
smaller and the healthy peers of the slow device in its replica idle.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titan_ext.runtime.falcon import device_clock
from titan_ext.runtime.falcon.restart import (
    S4_EXIT_CODE,
    S4_PLAN_FILE,
    plan_exclusion,
    read_s4_plan,
    relaunch_overrides,
    remap_emulation,
    write_s4_plan,
    ReplacePlan,
    plan_replacement,
)

__all__ = ["S4Unavailable", "plan_checkpoint_restart", "checkpoint_and_exit", "relaunch_spec", "estimate_s4_cost", "S4Resume", "recorded_s4_cost", "launch",
           "ENV_S4_PLAN", "OUTCOME_STEPS"]

ENV_S4_PLAN = "TITAN_EXT_S4_PLAN"
"""Set by the launcher in the restarted job: the path of the plan it was restarted from."""
COSTS_FILE = "falcon_costs.json"
OUTCOME_STEPS = 5
"""Steps after the restart whose median iteration time is the S4 outcome's "after"."""
_EMULATION_ENV = ("TITAN_EXT_SLOW_DEVICE", "TITAN_EXT_SLOW_LINK")


class S4Unavailable(RuntimeError):
    """S4 was decided but cannot be applied in this job (the reason is the message)."""


def devices_to_exclude(slow_devices, slow_links) -> list[int]:
    """The slow devices; for a slow link (which validation cannot pin on one end) its higher end."""
    if slow_devices:
        return sorted({int(d) for d in slow_devices})
    return sorted({max(int(a), int(b)) for a, b in slow_links})


def _save_checkpoint(trainer: Any, step: int) -> None:
    """TorchTitan's full checkpoint of ``step`` (not its model-only last-step save) now."""
    ckpt = trainer.checkpointer
    interval = ckpt.interval
    ckpt.interval = 1  # save() writes on step % interval == 0: this step, whatever the interval
    try:
        ckpt.save(step, last_step=False)
    finally:
        ckpt.interval = interval
    wait = getattr(ckpt, "_async_wait", None)
    if callable(wait):
        wait()  # async checkpointing: the files must be complete before this process exits


def plan_checkpoint_restart(checkpoint_enabled: bool, slow_devices, slow_links, grid: list[list[int]],
                            step: int, split: list[int], spares=(), device_of=None):
    """The S4 plan for this job now from validation's ``slow_devices`` / ``slow_links``: onto
    ``spares`` when there are enough (:func:`~titan_ext.runtime.falcon.restart.plan_replacement`:
    Falcon's S4, DP kept), else without them
    (:func:`~titan_ext.runtime.falcon.restart.plan_exclusion`: DP shrinks); or
    :class:`S4Unavailable` (on every rank alike: the inputs are) when TorchTitan's checkpointer is
    off, nothing was localised, or the global batch does not re-split."""
    if not checkpoint_enabled:
        raise S4Unavailable("S4 needs TorchTitan's checkpointer: [checkpoint] enable = true")
    excluded = devices_to_exclude(slow_devices, slow_links)
    if not excluded:
        raise S4Unavailable("validation localised no device or link to exclude")
    if spares:
        try:
            return plan_replacement(grid, excluded, spares, step, split, device_of)
        except ValueError:
            pass  # not enough spares (or an uneven split): without them
    try:
        return plan_exclusion(grid, excluded, step, split)
    except ValueError as e:
        raise S4Unavailable(str(e)) from None


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
        from titan_ext.titan.falcon.files import emulation_specs

        emulation = remap_emulation(plan, *emulation_specs(job.section))
        write_s4_plan(Path(trainer.job_config.job.dump_folder), plan, status="pending",
                      begin_time=begin, save_s=float(save_s),
                      estimated_cost_s=job.monitor.config.costs.of("checkpoint_restart"),
                      iteration_time_before_s=decision.get("falcon/iteration_time_s"),
                      overrides=relaunch_overrides(plan, emulation,
                                                   trainer.job_config.training.local_batch_size),
                      hosts=[where[r][0] for r in plan.kept_ranks],
                      local_devices=_local_devices(plan, where),
                      device_type=where[0][2])
    dist.barrier(group=job.control)
    if job.rank == 0:
        from torchtitan.tools.logging import logger

        logger.warning(f"[titan_ext] Falcon S4: checkpointed step {step} ({float(save_s):.2f} s); exiting "
                       f"with status {S4_EXIT_CODE} for a relaunch on ranks {plan.kept_ranks} without "
                       f"devices {plan.excluded} (python -m titan_ext.titan.falcon.s4 or scripts/launch.sh "
                       f"relaunch; a plain torchrun stops here)")
    trainer.close()
    dist.destroy_process_group()
    raise SystemExit(S4_EXIT_CODE)


def _local_devices(plan, where: list) -> list[int]:
    """The local device of each new rank: its old rank's, or for a rank moved onto a spare the
    spare (on GPUs a local CUDA index)."""
    out = []
    for i, r in enumerate(plan.kept_ranks):
        moved = isinstance(plan, ReplacePlan) and r in plan.excluded
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

    def __init__(self, plan: dict, dump_folder: Path, rank: int, trainer: Any = None, control: Any = None):
        self.plan, self.dump, self.rank, self.trainer = plan, Path(dump_folder), rank, trainer
        if control is None:
            from titan_ext.runtime.falcon.device_clock import control_group

            control = control_group()  # collective: every rank of the restarted job makes it
        self.control = control
        self.times: list[float] = []
        self.measured_s: float | None = None

    @classmethod
    def from_env(cls, trainer: Any) -> S4Resume | None:
        path = os.environ.get(ENV_S4_PLAN, "").strip()
        if not path:
            return None
        plan = json.loads(Path(path).read_text())
        return cls(plan, Path(trainer.job_config.job.dump_folder), dist.get_rank(), trainer)

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
                      "restart_and_load_s": self.measured_s - float(self.plan["save_s"])})
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
        ``falcon.jsonl``; after OUTCOME_STEPS steps the outcome row."""
        t = torch.tensor([step_s], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        self.times.append(float(t))
        if self.rank == 0:
            from titan_ext.titan.falcon.files import FALCON_LOG

            with open(self.dump / FALCON_LOG, "a") as f:
                f.write(json.dumps({"step": step, "falcon/iteration_time_s": float(t),
                                    "falcon/after_s4_from_step": self.plan["step"]}) + "\n")
        if len(self.times) == OUTCOME_STEPS:
            self._record({"kind": "outcome", "iteration": step, "strategy": "S4", "name": "checkpoint_restart",
                          "iteration_time_before_s": self.plan["iteration_time_before_s"],
                          "iteration_time_after_s": statistics.median(self.times)})

    def _record(self, row: dict) -> None:
        if self.rank != 0:
            return
        from torchtitan.tools.logging import logger

        from titan_ext.titan.falcon.files import FALCON_EVENTS

        with open(self.dump / FALCON_EVENTS, "a") as f:
            f.write(json.dumps(row) + "\n")
        logger.info(f"[titan_ext] Falcon S4 {row['kind']} at step {row['iteration']}: "
                    + ", ".join(f"{k} {v}" for k, v in row.items() if k.endswith("_s")))
        from titan_ext.titan.metrics import _wandb_loggers

        processor = getattr(self.trainer, "metrics_processor", None)
        for wb in _wandb_loggers(processor) if processor is not None else []:
            wb.wandb.log({f"falcon/s4_{row['kind']}/{k}": v for k, v in row.items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool)},
                         step=row["iteration"])


# ---------------------------------------------------------------------------- the launcher
def _dump_folder(train_args: list[str]) -> Path:
    for i, arg in enumerate(train_args):
        key, sep, value = arg.partition("=")
        if key in ("--job.dump_folder", "--job.dump-folder"):
            return Path(value if sep else train_args[i + 1])
    raise SystemExit("falcon.s4 launch: pass --job.dump_folder DIR among the training arguments")


def relaunch_env(plan: dict, env: dict[str, str]) -> dict[str, str]:
    """The restarted job's environment: the plan's path, no emulation from the environment (the plan
    carries it, renumbered), and on GPUs only the kept local devices visible."""
    env = {k: v for k, v in env.items() if k not in _EMULATION_ENV}
    if plan.get("device_type") == "cuda":
        if len(set(plan["hosts"])) > 1:
            raise SystemExit("falcon.s4 launch: a multi-node S4 restart is scripts/launch.sh's (SLURM)")
        visible = env.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(max(plan["local_devices"]) + 1)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[i] for i in plan["local_devices"])
    return env


def consume_plan(dump: Path) -> dict | None:
    """A pending S4 plan of ``dump`` (marked consumed, so one exit restarts once), or None."""
    plan = read_s4_plan(dump)
    if plan is None or plan.get("status") != "pending":
        return None
    plan["status"] = "consumed"
    path = dump / S4_PLAN_FILE
    path.write_text(json.dumps(plan, indent=1))
    return plan


def relaunch_spec(plan: dict, hosts: list[str]) -> dict:
    """What a multi-node launcher (scripts/launch.sh) runs after S4: the nodes of ``hosts`` (the
    allocation) that keep ranks, the same number on each (else SystemExit: torchrun starts as many
    ranks on every node), the nodes to exclude, and per kept node its visible devices. Which rank a
    kept device gets does not matter: every device left is healthy, and each new rank loads its
    stage from the checkpoint."""
    short = lambda h: h.split(".")[0]  # noqa: E731 (SLURM lists short names; gethostname may not)
    kept = {h: [d for hh, d in zip(plan["hosts"], plan["local_devices"]) if short(hh) == short(h)]
            for h in hosts}
    kept = {h: sorted(ds) for h, ds in kept.items() if ds}
    counts = {len(ds) for ds in kept.values()}
    if len(counts) != 1:
        raise SystemExit(f"falcon.s4: the kept ranks are uneven over the nodes ({kept}); "
                         f"torchrun needs the same number on every node")
    return {"nnodes": len(kept), "nproc_per_node": counts.pop(),
            "exclude": [h for h in hosts if h not in kept], "devices": kept,
            "overrides": plan["overrides"], "device_type": plan.get("device_type", "cpu")}


def _print_relaunch_spec(argv: list[str]) -> int:
    """``python -m titan_ext.titan.falcon.s4 relaunch-spec DUMP HOST...``: consume DUMP's pending plan
    and print shell assignments (S4_NNODES, S4_NPROC_PER_NODE, S4_EXCLUDE, S4_ARGS, S4_DEVICES_<i>
    per host in the order given); exit 1 when there is no pending plan."""
    import shlex

    plan = consume_plan(Path(argv[0]))
    if plan is None:
        return 1
    spec = relaunch_spec(plan, argv[1:])
    print(f"S4_NNODES={spec['nnodes']}")
    print(f"S4_NPROC_PER_NODE={spec['nproc_per_node']}")
    print(f"S4_EXCLUDE={shlex.quote(','.join(spec['exclude']))}")
    print(f"S4_ARGS={shlex.quote(shlex.join(spec['overrides']))}")
    print(f"S4_PLAN={shlex.quote(str(Path(argv[0]) / S4_PLAN_FILE))}")
    for i, host in enumerate(argv[1:]):
        ids = ",".join(str(d) for d in spec["devices"].get(host, []))
        print(f"S4_DEVICES_{i}={shlex.quote(ids)}")
    return 0


def launch(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``python -m titan_ext.titan.falcon.s4 --nproc-per-node 4 [--max-s4 1] -- <titan_ext.train args>``:
    torchrun; after an S4 exit, torchrun again on the plan's world with its overrides."""
    p = argparse.ArgumentParser(prog=prog or "python -m titan_ext.titan.falcon.s4", description=launch.__doc__)
    p.add_argument("--nproc-per-node", type=int, required=True)
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--max-s4", type=int, default=1, help="restarts allowed (default 1)")
    p.add_argument("--log", default="", help="append every run's output to this file")
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    train_args = [x for x in a.train_args if x != "--"] if a.train_args[:1] == ["--"] else a.train_args
    dump = _dump_folder(train_args)
    (dump / S4_PLAN_FILE).unlink(missing_ok=True)
    nproc, extra, env, port = a.nproc_per_node, [], dict(os.environ), a.master_port
    for attempt in range(a.max_s4 + 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(port),
               "-m", "titan_ext.train", *train_args, *extra]
        out = open(a.log, "a") if a.log else None
        try:
            rc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None).returncode
        finally:
            if out is not None:
                out.close()
        plan = consume_plan(dump) if rc != 0 else None
        if plan is None or attempt == a.max_s4:
            return rc
        print(f"[falcon.s4] S4 at step {plan['step']}: excluding devices {plan['excluded']}, relaunching "
              f"on {plan['world_size']} ranks (DP {plan['num_dp']} x PP {plan['num_pp']})", flush=True)
        nproc, extra, port = plan["world_size"], plan["overrides"], port + 1
        env = relaunch_env(plan, env) | {ENV_S4_PLAN: str(dump / S4_PLAN_FILE)}
    return rc


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``titan-ext falcon-s4`` / ``python -m titan_ext.titan.falcon.s4``: :func:`launch`, or
    ``relaunch-spec DUMP HOST...`` (what scripts/launch.sh reads after an S4 exit)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["relaunch-spec"]:
        return _print_relaunch_spec(argv[1:])
    return launch(argv, prog=prog)


if __name__ == "__main__":
    sys.exit(main())
