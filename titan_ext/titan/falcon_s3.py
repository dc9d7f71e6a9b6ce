"""S3 applied in the running TorchTitan job: the in-memory topology change.

Falcon §5.3 "Adjust topology": pause training, re-map the DP × PP grid so that a slow link carries
the least critical traffic (a slow DP link becomes a PP hop), swap the stages' state between devices
and resume — no checkpoint files, no process restart (Falcon reports it 6.72× faster than through
a checkpoint). :func:`apply_topology` does it between two steps of TorchTitan 0.2.2's ``Trainer``:

1. **Groups.** A ``DeviceMesh`` of the new grid (``mesh[pp][dp] = grid[dp][pp]``, dims ``pp`` and
   ``dp_replicate``), collective over the world; the trainer's ``parallel_dims`` is wrapped so that
   ``pp``, ``batch``, ``loss`` and ``dp_replicate`` answer with the new mesh's groups
   (:class:`RemappedDims`) — every collective TorchTitan's ``train_step`` and our DP sync issue
   (global token count, loss, gradient-norm clipping, gradient sum) follows the new layout.
2. **Stage.** The model part, its ``PipelineStage`` and the PP schedule are rebuilt by TorchTitan's
   own ``train_spec.pipelining_fn`` on a meta-device model with the remapped dims (so our schedule
   builder, the pipeline metrics and the split rules apply as at start-up); the optimizer and lr
   scheduler by ``build_optimizers_fn`` / ``build_lr_schedulers_fn``.
3. **State.** The stage's model + optimizer state comes from the old holder of the rank's new role
   over point-to-point messages (:func:`titan_ext.runtime.falcon.topology.exchange_stage_state`;
   the rank's own state when its stage is unchanged); the lr schedule state is the same on every
   rank. A rank whose DP replica changes takes over that replica's data loader state (host data on
   the control group), so it reads the batches its new replica would have read.
4. **Trainer.** ``model_parts``, ``pp_schedule``, ``pp_has_first/last_stage``, ``optimizers``,
   ``lr_schedulers``, ``dataloader`` (and the metrics processor's and checkpointer's references)
   point at the new objects; the data iterator is the job's (:attr:`FalconJob.data_iterator`). The
   logged loss is replica 0's last stage's on every rank (TorchTitan's metrics rank is fixed by the
   mesh's sizes and may now hold stage 0).

Training after the change computes exactly what the old layout would have (the same stages on the
same data, reductions over two members are order-free), which ``tests/falcon/test_falcon_job.py`` checks
against a run without the change. Limits: one model part per rank (our schedules' split), no
TP / CP / FSDP (the DP × PP job :func:`~titan_ext.titan.falcon_dp.replicated_by_trainer`), and each
new pipeline's ranks in increasing stage order (the schedule numbers PP group members by global
rank); a plan that breaks these raises ``ValueError`` before anything changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titan_ext.runtime.falcon.restart import role_of
from titan_ext.runtime.falcon.topology import exchange_stage_state, load_stage_state, own_stage_state

__all__ = ["RemappedDims", "grid_mesh", "check_grid", "apply_topology", "S3Result"]

_REMAPPED = {"pp": "pp", "batch": "dp_replicate", "loss": "dp_replicate", "dp_replicate": "dp_replicate"}
"""TorchTitan mesh names → the new mesh's dim (DP × PP only: batch = loss = dp_replicate)."""


class RemappedDims:
    """TorchTitan's ``ParallelDims`` with the meshes of :data:`_REMAPPED` taken from ``mesh``."""

    def __init__(self, dims: Any, mesh: DeviceMesh):
        self._dims = getattr(dims, "_dims", dims)  # never wrap a wrapper
        self._mesh = mesh

    def _remapped(self, names):
        name = names if isinstance(names, str) else (names[0] if len(names) == 1 else None)
        return self._mesh[_REMAPPED[name]] if name in _REMAPPED else None

    def get_mesh(self, names):
        mesh = self._remapped(names)
        return mesh if mesh is not None else self._dims.get_mesh(names)

    def get_optional_mesh(self, names):
        mesh = self._remapped(names)
        return mesh if mesh is not None else self._dims.get_optional_mesh(names)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dims, name)


def grid_mesh(grid, device_type: str) -> DeviceMesh:
    """A ``(pp, dp_replicate)`` device mesh whose rows are the grid's pipelines (collective)."""
    mesh = torch.tensor([[int(x) for x in row] for row in grid], dtype=torch.int64).T.contiguous()
    return DeviceMesh(device_type, mesh, mesh_dim_names=("pp", "dp_replicate"))


def s3_can_move(part: torch.nn.Module) -> bool:
    """S3 moves a plain stage module's state (:mod:`titan_ext.runtime.falcon.topology`); an FSDP-wrapped
    one (TorchTitan 0.3's DP x PP job shards over a size-1 mesh) holds DTensors it does not move."""
    from torch.distributed.fsdp import FSDPModule

    return not isinstance(part, FSDPModule)


def check_grid(old_grid, new_grid, trainer: Any) -> None:
    """The limits of the module docstring, before any group or state changes (ValueError)."""
    flat = sorted(int(r) for row in new_grid for r in row)
    if flat != sorted(int(r) for row in old_grid for r in row):
        raise ValueError(f"S3: new grid {new_grid} is not a permutation of {old_grid}")
    if len(new_grid) != len(old_grid) or any(len(r) != len(old_grid[0]) for r in new_grid):
        raise ValueError(f"S3: new grid {new_grid} changes the DP x PP shape of {old_grid}")
    unordered = [list(r) for r in new_grid if list(r) != sorted(r)]
    if unordered:
        raise ValueError(f"S3: pipelines {unordered} are not in increasing rank order (the schedule numbers "
                         f"a PP group's members by global rank)")
    if len(trainer.model_parts) != 1:
        raise ValueError(f"S3 moves one model part per rank, this rank holds {len(trainer.model_parts)}")
    if not s3_can_move(trainer.model_parts[0]):
        raise ValueError("S3 moves plain stage modules only, this one is FSDP-wrapped")
    dims = trainer.parallel_dims
    if getattr(dims, "tp", 1) > 1 or getattr(dims, "cp", 1) > 1 or getattr(dims, "dp_shard", 1) > 1:
        raise ValueError("S3 is applied in DP x PP jobs only (no TP, CP or FSDP)")


@dataclass
class S3Result:
    """What one application did (rank-local) and cost (slowest rank's)."""

    old_role: tuple[int, int]
    new_role: tuple[int, int]
    received_from: int | None
    """Global rank whose stage state this rank took (None: it kept its stage)."""
    seconds: float
    """Wall time of the whole change, max over ranks (the ski-rental cost, §5.2)."""
    mesh: DeviceMesh


def apply_topology(trainer: Any, old_grid, new_grid, control_group: Any = None) -> S3Result:
    """Re-map the running trainer from ``old_grid`` to ``new_grid`` (``grid[dp][pp]`` = global rank),
    in memory (collective over the world; call between steps, after the optimizer step)."""
    check_grid(old_grid, new_grid, trainer)
    t0 = time.perf_counter()
    rank = dist.get_rank()
    old_role, new_role = role_of(old_grid, rank), role_of(new_grid, rank)
    mesh = grid_mesh(new_grid, trainer.device.type)
    dims = RemappedDims(trainer.parallel_dims, mesh)
    old_part, old_opt = trainer.model_parts[0], trainer.optimizers.optimizers[0]
    moved = exchange_stage_state(old_grid, new_grid, old_part, old_opt, control_group, trainer.device)
    lr_state = trainer.lr_schedulers.state_dict()
    _rebuild_stage(trainer, dims)
    new_part, new_opt = trainer.model_parts[0], trainer.optimizers.optimizers[0]
    if moved is None:
        load_stage_state(new_part, new_opt, *own_stage_state(old_part, old_opt))
    else:
        load_stage_state(new_part, new_opt, moved[1], moved[2])
    trainer.lr_schedulers.load_state_dict(lr_state)
    _take_over_loader(trainer, old_grid, new_grid, control_group)
    trainer.parallel_dims = dims
    _log_last_stage_loss(trainer, int(new_grid[0][-1]), control_group)
    seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=control_group)
    return S3Result(old_role, new_role, None if moved is None else moved[0], float(seconds), mesh)


def _rebuild_stage(trainer: Any, dims: RemappedDims) -> None:
    """Step 2 of the module docstring: TorchTitan's own builders on the new groups."""
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.tools import utils

    from titan_ext.titan.registry import active_job_config

    spec, cfg = trainer.train_spec, trainer.job_config
    delegation = getattr(trainer.pp_schedule, "delegation", None)
    if delegation is not None:  # every adaptive schedule's transport (None: direct P2P)
        delegation.close()
    adaptive = getattr(trainer.pp_schedule, "adaptive", None)
    with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[cfg.training.dtype]):
        model = spec.model_cls(trainer.model_args)
    with active_job_config(cfg):
        schedule, parts, first, last = spec.pipelining_fn(
            model, dims, cfg, trainer.device, trainer.model_args, spec.parallelize_fn, trainer.loss_fn)
    rng = torch.get_rng_state()
    for part in parts:  # as TorchTitan's trainer does: the non-persistent buffers (RoPE) come from
        part.to_empty(device=trainer.device)  # init_weights; the parameters are overwritten next
        with torch.no_grad():
            part.init_weights(buffer_device=None)
        part.train()
    torch.set_rng_state(rng)  # the change draws no random numbers the run would not have drawn
    if adaptive is not None and hasattr(schedule, "adaptive"):
        schedule.adaptive = adaptive  # a PipeMorph re-plan applied before stays on
    optimizers = spec.build_optimizers_fn(parts, cfg.optimizer, dims)
    lr_schedulers = spec.build_lr_schedulers_fn(optimizers, cfg.lr_scheduler, cfg.training.steps)
    trainer.pp_schedule, trainer.model_parts = schedule, parts
    trainer.pp_has_first_stage, trainer.pp_has_last_stage = first, last
    trainer.optimizers, trainer.lr_schedulers = optimizers, lr_schedulers
    trainer.metrics_processor.optimizers = optimizers
    trainer.metrics_processor.model_parts = parts
    _repoint_checkpointer(trainer)


def _repoint_checkpointer(trainer: Any) -> None:
    """TorchTitan's checkpointer saves what its ``states`` dict holds: the new objects."""
    from torchtitan.components.checkpoint import (DATALOADER, LR_SCHEDULER, MODEL, OPTIMIZER,
                                                  ModelWrapper)

    states = getattr(getattr(trainer, "checkpointer", None), "states", None)
    if states is None:
        return
    states.update({MODEL: ModelWrapper(trainer.model_parts), OPTIMIZER: trainer.optimizers,
                   DATALOADER: trainer.dataloader, LR_SCHEDULER: trainer.lr_schedulers})


def _log_last_stage_loss(trainer: Any, holder: int, control_group: Any) -> None:
    """TorchTitan's metrics rank (W&B, the pipeline metrics file) is fixed by the mesh's sizes (the
    first rank of the last stage at start), and S3 may move it to another stage: every logged loss is
    the one of ``holder`` (replica 0's last stage now), broadcast over the control group."""
    proc = trainer.metrics_processor
    proc._titan_ext_loss_holder = holder
    if getattr(proc, "_titan_ext_log", None) is not None:
        return
    proc._titan_ext_log = original = proc.log

    def log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        losses = torch.tensor([float(global_avg_loss), float(global_max_loss)], dtype=torch.float64)
        dist.broadcast(losses, src=proc._titan_ext_loss_holder, group=control_group)
        return original(step, float(losses[0]), float(losses[1]), grad_norm, extra_metrics=extra_metrics)

    proc.log = log


def _take_over_loader(trainer: Any, old_grid, new_grid, control_group: Any) -> None:
    """A rank whose DP replica changes continues that replica's data stream: a data loader of the
    new DP rank, loaded with the state of the old holder of its new role (step 3)."""
    rank = dist.get_rank()
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, trainer.dataloader.state_dict(), group=control_group)
    new_dp, new_pp = role_of(new_grid, rank)
    if role_of(old_grid, rank)[0] == new_dp:
        return
    source = int(old_grid[new_dp][new_pp])
    loader = trainer.train_spec.build_dataloader_fn(
        dp_world_size=len(new_grid), dp_rank=new_dp, tokenizer=trainer.tokenizer,
        job_config=trainer.job_config)
    loader.load_state_dict(states[source])
    trainer.dataloader = loader
    _repoint_checkpointer(trainer)
