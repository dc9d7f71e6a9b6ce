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
grid (on replacement nodes). S4 *without* spare nodes (the job restarts on fewer devices, the slow
one excluded) is planned by :func:`plan_exclusion` (which replicas run again, the re-split batch,
the restarted job's overrides); :mod:`titan_ext.titan.falcon_s4` applies it with TorchTitan's
checkpointer and a relaunch.
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass, field
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
    "S4_EXIT_CODE",
    "S4_PLAN_FILE",
    "ShrinkPlan",
    "plan_exclusion",
    "remap_emulation",
    "relaunch_overrides",
    "write_s4_plan",
    "read_s4_plan",
    "S4Unavailable",
    "devices_to_exclude",
    "ENV_SPARE_NODES",
    "NodeReplacePlan",
    "plan_node_replacement",
    "spare_nodes_from_env",
    "plan_checkpoint_restart",
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
    ``timeout_s`` (None: the job's current timeout, ``runtime.comm.timeouts``)."""
    from ..comm.timeouts import new_group

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
    """Atomically write one PP stage's state (call on the DP-replica-0 rank of that stage).

    ``extra`` must be plain data (tensors, dicts, lists, tuples, numbers, strings, None): that is all
    :func:`load_stage_checkpoint` reads."""
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
    """Load a stage's state into ``model`` (and ``optimizer``); returns the raw state dict.

    The file is read with ``torch.load(weights_only=True)``: tensors and plain data only, what
    :func:`save_stage_checkpoint` writes (model and optimizer state dicts need no allowlist). A file
    holding any other object (a crafted pickle) is refused with a one-line ValueError naming it; no
    function the file names is called."""
    path = _stage_path(directory, stage)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"refused to load {path}: it holds objects other than tensors and plain data "
                         f"(not written by save_stage_checkpoint); delete it and save the stage again") from None
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
    """The planned grid, or the identity grid if no plan was written. ValueError (naming the file)
    unless it is a ``num_dp`` x ``num_pp`` grid holding each rank ``0 .. num_dp * num_pp - 1`` once."""
    path = Path(directory) / _PLAN_FILE
    if not path.exists():
        return identity_grid(num_dp, num_pp)
    try:
        grid = json.loads(path.read_text())["grid"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"restart plan {path}: no grid in it ({e})") from None
    if not (isinstance(grid, list) and len(grid) == num_dp
            and all(isinstance(r, list) and len(r) == num_pp for r in grid)):
        raise ValueError(f"restart plan {path}: grid {grid} is not {num_dp}x{num_pp}")
    ranks = [x for r in grid for x in r]
    if not all(type(x) is int for x in ranks) or sorted(ranks) != list(range(num_dp * num_pp)):
        raise ValueError(f"restart plan {path}: grid {grid} does not hold each rank 0..{num_dp * num_pp - 1} once")
    return grid


# ---------------------------------------------------------------------------- S4: restart on fewer devices
S4_EXIT_CODE = 75
"""Exit status of every rank of a job that checkpointed for S4 (EX_TEMPFAIL): the launcher relaunches."""
S4_PLAN_FILE = "falcon_s4_plan.json"
"""Written by rank 0 in the dump folder before the S4 exit; read by the launcher and the new job."""
_CLEARED_EMULATION = {"emulate_slow_device": "", "emulate_slow_link": ""}


@dataclass
class ShrinkPlan:
    """Falcon §5.1 S4 (checkpoint-and-restart: "performs checkpointing and restarts training on healthy
    nodes") without spare nodes: the DP replicas holding an excluded device are dropped, the job restarts
    as ``num_dp`` × ``num_pp`` on the remaining ranks, and the global batch is re-split over the kept
    replicas."""

    step: int
    grid: list[list[int]]
    excluded: list[int]
    kept_replicas: list[int]
    num_pp: int
    chunks_per_replica: int
    """Gradient-accumulation chunks of each kept replica: the same global batch, evenly re-split."""

    @property
    def num_dp(self) -> int:
        return len(self.kept_replicas)

    @property
    def kept_ranks(self) -> list[int]:
        """Old global ranks that run again, in new-rank order: TorchTitan's mesh is pp-outermost
        (new rank ``s * num_dp + i`` runs stage s of the i-th kept replica)."""
        return [int(self.grid[d][s]) for s in range(self.num_pp) for d in self.kept_replicas]

    def new_rank(self, old_rank: int) -> int | None:
        kept = self.kept_ranks
        return kept.index(old_rank) if old_rank in kept else None


@dataclass
class ReplacePlan(ShrinkPlan):
    """Falcon §5.1 S4 as the paper runs it ("restarts training on healthy nodes"): every rank
    on an excluded device restarts on a spare device; the grid, DP and the split stay (new rank =
    the rank of the same role). ``devices[i]``: the device new rank i runs on; ``replaced``:
    excluded device → its spare; ``spares_left``: spares still unused."""

    devices: list[int] = field(default_factory=list)
    replaced: dict = field(default_factory=dict)
    spares_left: list[int] = field(default_factory=list)


def plan_replacement(grid, excluded, spares, step: int, split: list[int], device_of=None) -> ReplacePlan:
    """The S4 plan onto spare devices: ``excluded`` ranks (validation's slow devices, as mesh ranks)
    move to ``spares`` (device ids no rank uses; in order); every other rank keeps its device
    (``device_of[rank]``, identity by default). ValueError without enough spares or a split TorchTitan
    cannot keep (uneven)."""
    excluded = sorted({int(x) for x in excluded})
    ranks = [int(r) for row in grid for r in row]
    device_of = list(range(len(ranks))) if device_of is None else [int(d) for d in device_of]
    if not excluded:
        raise ValueError("S4 needs at least one device to exclude")
    unknown = [x for x in excluded if x not in ranks]
    if unknown:
        raise ValueError(f"devices {unknown} are not in the grid {grid}")
    spares = [int(d) for d in spares if int(d) not in device_of]
    if len(spares) < len(excluded):
        raise ValueError(f"{len(excluded)} device(s) to replace ({excluded}) but {len(spares)} spare(s) {spares}")
    total = sum(int(m) for m in split)
    if total % len(grid):
        raise ValueError(f"the global batch of {total} chunks does not split evenly over {len(grid)} replicas")
    replaced = {device_of[r]: spares[i] for i, r in enumerate(excluded)}
    num_pp = len(grid[0])
    kept = list(range(len(grid)))
    order = [int(grid[d][s]) for s in range(num_pp) for d in kept]  # new rank i plays old rank order[i]
    devices = [replaced.get(device_of[r], device_of[r]) for r in order]
    return ReplacePlan(step, [[int(r) for r in row] for row in grid], excluded, kept, num_pp, total // len(kept),
                       devices=devices, replaced=replaced, spares_left=spares[len(excluded):])


def plan_exclusion(grid, excluded, step: int, split: list[int]) -> ShrinkPlan:
    """The S4 plan for ``grid`` (``grid[dp][pp]`` global ranks) without the devices ``excluded``.

    ``split``: the chunks each replica runs now (the global batch is ``sum(split)`` chunks); it
    must divide evenly over the kept replicas (TorchTitan splits a global batch evenly over DP)."""
    excluded = sorted({int(x) for x in excluded})
    if not excluded:
        raise ValueError("S4 needs at least one device to exclude")
    unknown = [x for x in excluded if not any(x in map(int, row) for row in grid)]
    if unknown:
        raise ValueError(f"devices {unknown} are not in the grid {grid}")
    kept = [d for d, row in enumerate(grid) if not set(map(int, row)) & set(excluded)]
    if not kept:
        raise ValueError(f"excluding {excluded} leaves no DP replica of grid {grid}")
    total = sum(int(m) for m in split)
    if total % len(kept):
        raise ValueError(f"the global batch of {total} chunks does not split evenly over {len(kept)} "
                         f"replicas")
    return ShrinkPlan(step, [[int(r) for r in row] for row in grid], excluded, kept, len(grid[0]),
                      total // len(kept))


def remap_emulation(plan: ShrinkPlan, slow_device: str, slow_link: str) -> dict[str, str]:
    """The ``[titan_ext] emulate_*`` specs of the restarted job: device ids renumbered to new ranks,
    a fault on an excluded device gone with it (and none at all on a DP 1 world, which has no
    trainer-owned DP to emulate on)."""
    from .emulation import parse_slow_device, parse_slow_link

    if isinstance(plan, ReplacePlan):
        # faults belong to devices: they stay where they are; a fault on a device no rank uses any
        # more is dropped (the restarted job's emulation knows only its devices)
        used = set(plan.devices)
        out = dict(_CLEARED_EMULATION)
        dev = parse_slow_device(slow_device)
        if dev is not None and dev.device in used:
            out["emulate_slow_device"] = slow_device
        link = parse_slow_link(slow_link)
        if link is not None and set(link.devices) <= used:
            out["emulate_slow_link"] = slow_link
        out["falcon_devices"] = ",".join(str(d) for d in plan.devices)
        out["falcon_spares"] = ",".join(str(d) for d in plan.spares_left)
        return out
    if plan.num_dp < 2:
        return dict(_CLEARED_EMULATION)
    out = dict(_CLEARED_EMULATION)
    dev = parse_slow_device(slow_device)
    if dev is not None and plan.new_rank(dev.device) is not None:
        out["emulate_slow_device"] = f"{plan.new_rank(dev.device)}:{dev.factor:g}@{dev.from_step}"
    link = parse_slow_link(slow_link)
    if link is not None and all(plan.new_rank(d) is not None for d in link.devices):
        a, b = sorted(plan.new_rank(d) for d in link.devices)
        out["emulate_slow_link"] = f"{a}-{b}:{link.delay_ms:g}@{link.from_step}"
    return out


def relaunch_overrides(plan: ShrinkPlan, emulation: dict[str, str], local_batch_size: int) -> list[str]:
    """TorchTitan command-line overrides of the restarted job (after the original arguments).

    The global batch is passed explicitly (``sum(split)`` chunks of ``local_batch_size``): a job
    that left it to TorchTitan's default (local × DP) would otherwise shrink it with the world.
    The data loader's state is not loaded: TorchTitan 0.2.2 cannot reshard it to another DP degree
    (its state asserts the DP world size), so the new loaders start their shards afresh."""
    global_batch = plan.chunks_per_replica * plan.num_dp * int(local_batch_size)
    args = ["--parallelism.data_parallel_replicate_degree", str(plan.num_dp),
            "--training.global_batch_size", str(global_batch),
            "--checkpoint.enable", "--checkpoint.exclude_from_loading", "dataloader"]
    for key, spec in emulation.items():
        args += [f"--titan_ext.{key}", spec]
    return args


def write_s4_plan(directory, plan: ShrinkPlan, **extra) -> Path:
    """Atomically write the S4 plan (plus ``extra``: timings, overrides, device map) as JSON."""
    path = Path(directory) / S4_PLAN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"step": plan.step, "grid": plan.grid, "excluded": plan.excluded,
            "kept_replicas": plan.kept_replicas, "num_pp": plan.num_pp,
            "chunks_per_replica": plan.chunks_per_replica, "kept_ranks": plan.kept_ranks,
            "num_dp": plan.num_dp, "world_size": len(plan.kept_ranks),
            "mode": "replace" if isinstance(plan, ReplacePlan) else "shrink",
            **({"devices": plan.devices, "replaced": {str(k): v for k, v in plan.replaced.items()}}
               if isinstance(plan, ReplacePlan) else {}), **extra}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(body, indent=1))
    os.replace(tmp, path)
    return path


def read_s4_plan(directory) -> dict | None:
    """The S4 plan written in ``directory`` (a dict, see :func:`write_s4_plan`), or None."""
    path = Path(directory) / S4_PLAN_FILE
    return json.loads(path.read_text()) if path.exists() else None


# ---- S4's plan for the job now: spare devices, else spare nodes, else the shrink

ENV_SPARE_NODES = "TITAN_EXT_SPARE_NODES"
"""Set by scripts/launch.sh under SLURM: how many nodes of the allocation the job does not use (spare
nodes). S4 then restarts the slow device's node on one of them (``srun --exclude``, the same node
count) instead of shrinking DP (:func:`plan_node_replacement`)."""

class S4Unavailable(RuntimeError):
    """S4 was decided but cannot be applied in this job (the reason is the message)."""


def devices_to_exclude(slow_devices, slow_links) -> list[int]:
    """The slow devices; for a slow link (which validation cannot pin on one end) its higher end."""
    if slow_devices:
        return sorted({int(d) for d in slow_devices})
    return sorted({max(int(a), int(b)) for a, b in slow_links})


@dataclass
class NodeReplacePlan(ReplacePlan):
    """S4 onto spare nodes (Falcon §5.1: "restarts training on healthy nodes"): every rank of a node
    holding an excluded device restarts on a spare node of the launcher's allocation; the grid, DP and
    the split stay. ``devices``: each new rank's device id, those of a replaced node renumbered to
    the spare node's (so that an emulated fault of the excluded node does not follow);
    ``excluded_nodes``: the node indices (global rank // ``ranks_per_node``, torchrun's contiguous
    numbering) the relaunch excludes."""

    excluded_nodes: list[int] = field(default_factory=list)
    ranks_per_node: int = 1


def plan_node_replacement(grid, excluded, spare_nodes: int, ranks_per_node: int, step: int, split: list[int],
                          device_of=None) -> NodeReplacePlan:
    """The S4 plan onto ``spare_nodes`` spare nodes of ``ranks_per_node`` devices each: the nodes holding
    an ``excluded`` rank are replaced whole (device ids of spare node j: the first unused id + j *
    ``ranks_per_node`` + local index), every other rank keeps its device, new rank i plays the rank of
    the same (stage, replica) as in :func:`~titan_ext.runtime.falcon.restart.plan_replacement`.
    ValueError with fewer spare nodes than nodes to replace, a world that is not whole nodes, or a
    split TorchTitan cannot keep (uneven)."""
    excluded = sorted({int(x) for x in excluded})
    ranks = [int(r) for row in grid for r in row]
    world, rpn = len(ranks), int(ranks_per_node)
    device_of = list(range(world)) if device_of is None else [int(d) for d in device_of]
    if not excluded:
        raise ValueError("S4 needs at least one device to exclude")
    unknown = [x for x in excluded if x not in ranks]
    if unknown:
        raise ValueError(f"devices {unknown} are not in the grid {grid}")
    if rpn < 1 or world % rpn:
        raise ValueError(f"{world} ranks are not whole nodes of {rpn}")
    nodes = sorted({r // rpn for r in excluded})
    if len(nodes) > int(spare_nodes):
        raise ValueError(f"{len(nodes)} node(s) to replace ({nodes}) but {int(spare_nodes)} spare node(s)")
    total = sum(int(m) for m in split)
    if total % len(grid):
        raise ValueError(f"the global batch of {total} chunks does not split evenly over {len(grid)} replicas")
    first = max(max(device_of), world - 1) + 1
    moved = {r: first + nodes.index(r // rpn) * rpn + r % rpn for r in range(world) if r // rpn in nodes}
    num_pp, kept = len(grid[0]), list(range(len(grid)))
    order = [int(grid[d][s]) for s in range(num_pp) for d in kept]
    return NodeReplacePlan(step, [[int(r) for r in row] for row in grid], excluded, kept, num_pp, total // len(kept),
                           devices=[moved.get(r, device_of[r]) for r in order],
                           replaced={device_of[r]: d for r, d in sorted(moved.items())}, spares_left=[],
                           excluded_nodes=nodes, ranks_per_node=rpn)


def spare_nodes_from_env(environ=os.environ) -> tuple[int, int | None]:
    """(:data:`ENV_SPARE_NODES`, torchrun's ``LOCAL_WORLD_SIZE``): the launcher's spare nodes (0 when
    unset or not a count) and the ranks per node (None when unknown)."""
    def count(name):
        text = environ.get(name, "").strip()
        return int(text) if text.isascii() and text.isdigit() else None
    return count(ENV_SPARE_NODES) or 0, count("LOCAL_WORLD_SIZE")


def plan_checkpoint_restart(checkpoint_enabled: bool, slow_devices, slow_links, grid: list[list[int]],
                            step: int, split: list[int], spares=(), device_of=None, spare_nodes=None):
    """The S4 plan for this job now from validation's ``slow_devices`` / ``slow_links``, Falcon's S4
    whenever there is somewhere healthy to restart: onto ``spares`` when there are enough
    (:func:`~titan_ext.runtime.falcon.restart.plan_replacement`), else onto the launcher's spare nodes
    (``spare_nodes``: (count, ranks per node); default :func:`spare_nodes_from_env`;
    :func:`plan_node_replacement`) -- both keep the grid and DP; only without either the shrink
    (:func:`~titan_ext.runtime.falcon.restart.plan_exclusion`: DP shrinks), its ``shrink_reason`` saying
    why. :class:`S4Unavailable` (on every rank alike: the inputs are) when TorchTitan's checkpointer is
    off, nothing was localised, or the global batch does not re-split."""
    if not checkpoint_enabled:
        raise S4Unavailable("S4 needs TorchTitan's checkpointer: [checkpoint] enable = true")
    excluded = devices_to_exclude(slow_devices, slow_links)
    if not excluded:
        raise S4Unavailable("validation localised no device or link to exclude")
    reasons = []
    if spares:
        try:
            return plan_replacement(grid, excluded, spares, step, split, device_of)
        except ValueError as e:  # not enough spares (or an uneven split)
            reasons.append(f"spare devices {list(spares)}: {e}")
    else:
        reasons.append("no spare devices ([titan_ext] falcon_spares is empty)")
    count, per_node = spare_nodes_from_env() if spare_nodes is None else spare_nodes
    if count and per_node:
        try:
            return plan_node_replacement(grid, excluded, count, per_node, step, split, device_of)
        except ValueError as e:
            reasons.append(f"spare nodes: {e}")
    else:
        reasons.append(f"no spare nodes (the launcher's {ENV_SPARE_NODES} is unset or 0)")
    try:
        plan = plan_exclusion(grid, excluded, step, split)
    except ValueError as e:
        raise S4Unavailable(f"{e}; and no spare path: {'; '.join(reasons)}") from None
    plan.shrink_reason = "; ".join(reasons)
    return plan
