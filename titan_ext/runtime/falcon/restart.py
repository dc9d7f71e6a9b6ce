"""Checkpoint-and-restart with a permuted DP × PP mesh (Falcon §5.3 "Adjust topology", S3/S4).

Falcon applies a topology adjustment by pausing training, dumping parameters, swapping them between
devices and restoring. Here it is done with files so it works with any launcher:

1. Before stopping, the ranks of DP replica 0 save their stage's state (model + optimizer + step):
   :func:`save_stage_checkpoint` (one file per PP stage — DP replicas hold identical state).
2. Rank 0 writes the planned grid (:class:`~titan_ext.runtime.falcon.mitigation.TopologyPlan`) with
   :func:`write_restart_plan`; the job exits and is relaunched (same world size).
3. On start, every rank reads the grid (:func:`read_restart_plan`, identity if none), takes the role
   ``(dp, pp)`` of its position in the grid (:func:`role_of`), builds the DP/PP groups of that grid
   (:func:`build_mesh_groups`) and loads its stage's state (:func:`load_stage_checkpoint`).

With an unchanged world size, "plain checkpoint-and-restart" (S4) is the same path with the identity
grid (on replacement nodes).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = [
    "MeshGroups",
    "identity_grid",
    "role_of",
    "build_mesh_groups",
    "stage_index_to_group_rank",
    "save_stage_checkpoint",
    "load_stage_checkpoint",
    "write_restart_plan",
    "read_restart_plan",
]

_PLAN_FILE = "falcon_restart_plan.json"


def identity_grid(num_dp: int, num_pp: int) -> list[list[int]]:
    """``grid[dp][pp] = dp * num_pp + pp`` (replica-major, like ``DeviceMesh(["dp", "pp"])``)."""
    return [[d * num_pp + s for s in range(num_pp)] for d in range(num_dp)]


def role_of(grid, rank: int) -> tuple[int, int]:
    for d, row in enumerate(grid):
        for s, r in enumerate(row):
            if int(r) == rank:
                return d, s
    raise KeyError(f"rank {rank} not in grid {grid}")


@dataclass
class MeshGroups:
    dp_index: int
    pp_index: int
    dp_group: object
    """Process group of this rank's stage across replicas (grid column)."""
    pp_group: object
    """Process group of this rank's pipeline (grid row, ordered by stage)."""
    dp_ranks: list[int]
    pp_ranks: list[int]


def build_mesh_groups(grid, backend: str | None = None, timeout_s: float | None = None) -> MeshGroups:
    """Create every row (PP) and column (DP) group of ``grid`` (collective: all ranks call it), with
    ``timeout_s`` (None: the job's current timeout, ``runtime.timeouts``)."""
    from ..timeouts import new_group

    rank = dist.get_rank()
    num_dp, num_pp = len(grid), len(grid[0])
    if num_dp * num_pp != dist.get_world_size():
        raise ValueError(f"grid {num_dp}x{num_pp} does not match world size {dist.get_world_size()}")
    my_dp, my_pp = role_of(grid, rank)
    pp_group = dp_group = None
    pp_ranks = dp_ranks = None
    for d in range(num_dp):
        ranks = [int(x) for x in grid[d]]
        g = new_group(ranks, timeout_s, backend=backend)
        if d == my_dp:
            pp_group, pp_ranks = g, ranks
    for s in range(num_pp):
        ranks = [int(grid[d][s]) for d in range(num_dp)]
        g = new_group(ranks, timeout_s, backend=backend)
        if s == my_pp:
            dp_group, dp_ranks = g, ranks
    return MeshGroups(my_dp, my_pp, dp_group, pp_group, dp_ranks, pp_ranks)


def stage_index_to_group_rank(pp_ranks) -> dict[int, int]:
    """Stage → rank *within the PP group* for a pipeline whose stage s runs on global rank
    ``pp_ranks[s]``. ``dist.new_group`` numbers members in sorted global-rank order, so a permuted row
    (e.g. ``[3, 1]``) needs this map (assign it to ``PipelineStage.stage_index_to_group_rank``)."""
    order = sorted(int(r) for r in pp_ranks)
    return {s: order.index(int(r)) for s, r in enumerate(pp_ranks)}


def _stage_path(directory, stage: int) -> Path:
    return Path(directory) / f"falcon_stage{stage}.pt"


def save_stage_checkpoint(directory, stage: int, model: torch.nn.Module,
                          optimizer: torch.optim.Optimizer | None = None, step: int = 0,
                          extra: dict | None = None) -> Path:
    """Atomically write one PP stage's state (call on the DP-replica-0 rank of that stage)."""
    path = _stage_path(directory, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "stage": stage,
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "extra": extra or {},
    }
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def load_stage_checkpoint(directory, stage: int, model: torch.nn.Module,
                          optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a stage's state into ``model`` (and ``optimizer``); returns the raw state dict."""
    state = torch.load(_stage_path(directory, stage), map_location="cpu", weights_only=False)
    if state["stage"] != stage:
        raise ValueError(f"checkpoint holds stage {state['stage']}, expected {stage}")
    model.load_state_dict(state["model"])
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    return state


def write_restart_plan(directory, grid, reason: str = "", step: int = 0) -> Path:
    path = Path(directory) / _PLAN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"grid": [[int(x) for x in row] for row in grid],
                               "reason": reason, "step": step}))
    os.replace(tmp, path)
    return path


def read_restart_plan(directory, num_dp: int, num_pp: int) -> list[list[int]]:
    """The planned grid, or the identity grid if no plan was written."""
    path = Path(directory) / _PLAN_FILE
    if not path.exists():
        return identity_grid(num_dp, num_pp)
    grid = json.loads(path.read_text())["grid"]
    if len(grid) != num_dp or any(len(r) != num_pp for r in grid):
        raise ValueError(f"restart plan grid {grid} is not {num_dp}x{num_pp}")
    return grid
