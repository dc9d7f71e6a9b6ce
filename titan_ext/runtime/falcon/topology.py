"""Topology adjustment in memory (Falcon §5.3 S3, "Adjust topology").

Falcon moves a slow link to where it carries the least critical traffic — a slow DP link becomes a
PP link — by pausing training, swapping the parameters between devices and resuming, without a
checkpoint or a process restart (Falcon reports this 6.72× faster than going through files). Here:

1. Every rank learns its new role ``(dp, pp)`` from the planned grid
   (:func:`~titan_ext.runtime.falcon.mitigation.plan_topology`).
2. A rank whose stage changes receives the new stage's state — model state dict and optimizer
   state, identical on every DP replica of a stage after the step's gradient sync — from the old
   holder of its new role, with point-to-point messages (one send and one receive per moving rank:
   the roles form a permutation). The tensor metadata (names, shapes, dtypes, optimizer
   hyper-parameters) is host data and travels on a control group; the tensors travel on the data
   (default) group, on the device, as batched P2P ops of the moving ranks only — which on NCCL need
   the default group's communicator to exist already (:func:`exchange_stage_state`).
3. The new stage module and optimizer come from the caller's ``build_stage(stage)``; the received
   state is loaded into them; the new DP / PP groups come from
   :func:`~titan_ext.runtime.falcon.restart.build_mesh_groups`.

The checkpoint-based path (:mod:`.restart`) is kept for S4 and as the reference.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .device_clock import ensure_communicator, has_communicator, to_device
from .restart import MeshGroups, build_mesh_groups, role_of

__all__ = ["StageState", "apply_topology_in_memory", "exchange_stage_state", "load_stage_state",
           "moving_ranks", "own_stage_state"]


@dataclass
class StageState:
    """A rank's stage after the change: its module, optimizer and groups."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    mesh: MeshGroups
    received_from: int | None
    """Global rank the state came from (None: this rank kept its stage)."""


def moving_ranks(old_grid, new_grid) -> dict[int, int]:
    """``{receiver: source}`` for every rank whose stage changes: the source is the old holder of
    the receiver's new role (a permutation: every rank sends and receives at most once)."""
    out = {}
    for d, row in enumerate(new_grid):
        for s, r in enumerate(row):
            if role_of(old_grid, int(r))[1] != s:
                out[int(r)] = int(old_grid[d][s])
    return out


def _flat_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list, dict]:
    """Tensors (model state, then optimizer state) in a canonical order, and their metadata."""
    model_sd, opt_sd = module.state_dict(), optimizer.state_dict()
    tensors, meta = [], {"model": [], "opt": [], "param_groups": opt_sd["param_groups"]}
    for k, v in model_sd.items():
        tensors.append(v)
        meta["model"].append((k, tuple(v.shape), v.dtype))
    for pid in sorted(opt_sd["state"]):
        for k, v in sorted(opt_sd["state"][pid].items()):
            if torch.is_tensor(v):
                tensors.append(v)
                meta["opt"].append((pid, k, tuple(v.shape), v.dtype, True))
            else:
                meta["opt"].append((pid, k, v, None, False))
    return tensors, meta


def _load_flat(module, optimizer, meta: dict, tensors: list) -> None:
    it = iter(tensors)
    module.load_state_dict({k: next(it) for k, _s, _d in meta["model"]})
    state: dict = {}
    for pid, k, shape_or_value, _dtype, is_tensor in meta["opt"]:
        state.setdefault(pid, {})[k] = next(it) if is_tensor else shape_or_value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def exchange_stage_state(old_grid, new_grid, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         control_group: Any = None, device=None) -> tuple[int, dict, list] | None:
    """Step 2 of the module docstring (collective over the world): every rank whose stage changes
    receives its new stage's state from the old holder of its new role.

    The moves are one ``batch_isend_irecv`` of the moving ranks on the default group.  On NCCL a
    group's first batched op needs *every* member (it creates the communicator: torch's
    ``batch_isend_irecv`` docstring), so a move of a subset hangs on a default group whose
    communicator does not exist: it must have been made (:func:`~.device_clock.ensure_communicator`;
    FalconJob does it at start-up, with S3's cost measurement).  Checked here: on a group without one,
    every rank makes it first (all ranks are here: a collective, never a subset's rendezvous) and
    says so — a communicator made mid-training, which the job never needs.

    Returns ``(source rank, metadata, tensors)`` on a receiving rank, None on a rank that keeps its
    stage (whose own ``module`` / ``optimizer`` hold the state). Load it with :func:`load_stage_state`."""
    rank = dist.get_rank()
    device = device if device is not None else next(module.parameters()).device
    if sorted(r for row in new_grid for r in row) != sorted(r for row in old_grid for r in row):
        raise ValueError(f"new grid {new_grid} is not a permutation of {old_grid}")
    moves = moving_ranks(old_grid, new_grid)
    if not has_communicator(None):
        warnings.warn("S3: the default group's communicator was not made at start-up "
                      "(device_clock.ensure_communicator): making it now, on every rank", stacklevel=2)
        ensure_communicator(None, device)
    tensors, meta = _flat_state(module, optimizer)
    metas: list = [None] * dist.get_world_size()
    dist.all_gather_object(metas, meta, group=control_group)
    ops, received, source = [], [], moves.get(rank)
    dst = next((r for r, src in moves.items() if src == rank), None)
    if dst is not None:
        ops += [dist.P2POp(dist.isend, to_device(t.contiguous(), device), dst) for t in tensors]
    if source is not None:
        src_meta = metas[source]
        shapes = [(s, d) for _k, s, d in src_meta["model"]] + [
            (s, d) for _p, _k, s, d, is_t in src_meta["opt"] if is_t]
        # the buffers the messages land in are the ones returned (to_device may copy: "cpu:3")
        received = [to_device(torch.empty(s, dtype=d, device=device), device) for s, d in shapes]
        ops += [dist.P2POp(dist.irecv, t, source) for t in received]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return None if source is None else (source, metas[source], received)


def load_stage_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict,
                     tensors: list) -> None:
    """Load a stage's state as :func:`exchange_stage_state` returns it into a fresh module and
    optimizer of the same stage (the same parameter order)."""
    _load_flat(module, optimizer, meta, tensors)


def own_stage_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list]:
    """This rank's own stage state (copies) in the form :func:`load_stage_state` takes: what a rank
    that keeps its stage loads into the rebuilt module and optimizer."""
    tensors, meta = _flat_state(module, optimizer)
    return meta, [t.detach().clone() for t in tensors]


def apply_topology_in_memory(old_grid, new_grid, module: torch.nn.Module,
                             optimizer: torch.optim.Optimizer,
                             build_stage: Callable[[int], tuple[torch.nn.Module, torch.optim.Optimizer]],
                             control_group: Any = None, device=None) -> StageState:
    """Re-map this rank from ``old_grid`` to ``new_grid`` in memory (collective over the world).

    ``module`` / ``optimizer``: this rank's current stage (state synchronised across DP replicas).
    ``build_stage(s)``: a fresh module and optimizer of stage ``s`` (called only on ranks whose
    stage changes). ``control_group``: where the metadata goes (a gloo group on a GPU job).
    """
    moved = exchange_stage_state(old_grid, new_grid, module, optimizer, control_group, device)
    new_mesh = build_mesh_groups(new_grid)
    if moved is None:
        return StageState(module, optimizer, new_mesh, None)
    source, meta, received = moved
    new_module, new_optimizer = build_stage(new_mesh.pp_index)
    load_stage_state(new_module, new_optimizer, meta, received)
    return StageState(new_module, new_optimizer, new_mesh, source)
