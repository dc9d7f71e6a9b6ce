"""Micro-batch redistribution across DP groups with weighted gradient aggregation (Falcon §5.3, S2).

With a global batch of M equal-size micro-batches split ``m_1..m_D`` over D DP groups (from
:func:`~titan_ext.runtime.falcon.mitigation.min_max_microbatch_split`), DP group i computes the mean
of its micro-batch losses ``L_i = (1/m_i) Σ_{j∈i} ℓ_j`` and its gradient ``g_i = ∇L_i``. The even-split
global loss is ``L = (1/M) Σ_j ℓ_j = Σ_i (m_i/M) L_i``, so aggregating with weights ``m_i / M``
(instead of DP's plain average ``1/D``) reproduces the even split's loss and gradients exactly
("weighted gradient aggregation", Falcon §5.3 citing [5]).

:func:`microbatch_ranges` assigns contiguous micro-batch indices to DP groups so the union of the
groups' data is the same global batch; :func:`weighted_all_reduce_gradients` does the aggregation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from .device_clock import to_device

__all__ = ["dp_weights", "microbatch_ranges", "redistribute_chunks", "weighted_all_reduce_gradients",
           "weighted_all_reduce_loss"]


def dp_weights(split: Sequence[int]) -> list[float]:
    """``m_i / M`` for every DP group."""
    total = sum(split)
    if total <= 0 or any(m < 0 for m in split):
        raise ValueError(f"invalid split {list(split)}")
    return [m / total for m in split]


def microbatch_ranges(split: Sequence[int]) -> list[range]:
    """Contiguous global micro-batch indices of every DP group: group i gets ``range(s_i, s_i + m_i)``."""
    out, start = [], 0
    for m in split:
        out.append(range(start, start + m))
        start += m
    return out


def redistribute_chunks(mine: Sequence, split: Sequence[int], dp_index: int, group=None) -> list:
    """This DP replica's share of the global batch under ``split`` (Falcon §5.3 S2).

    ``mine``: the equal-size chunks this replica's data loader produced for the step, each a tensor
    or a ``(dict of tensors, tensor)`` pair (TorchTitan's ``(input_dict, labels)``); every replica
    holds the same number of same-shape chunks. The chunks are all-gathered over the DP ``group``
    (ordered by replica: the global batch is unchanged) and replica ``dp_index`` gets
    ``microbatch_ranges(split)[dp_index]`` of them. Data-loader chunks are host data: on a GPU job
    ``group`` is the DP replicas' gloo control group (:func:`~.device_clock.control_group`), never
    the NCCL DP group.
    """
    leaves = [_leaves(c) for c in mine]
    gathered = [_all_gather_stacked([lv[k] for lv in leaves], group) for k in range(len(leaves[0]))]
    everyone = [_rebuild(mine[0], [g[j] for g in gathered]) for j in range(len(gathered[0]))]
    return [everyone[j] for j in microbatch_ranges(split)[dp_index]]


def _leaves(chunk) -> list[torch.Tensor]:
    if torch.is_tensor(chunk):
        return [chunk]
    inputs, labels = chunk
    return [inputs[k] for k in sorted(inputs)] + [labels]


def _rebuild(template, leaves: list[torch.Tensor]):
    if torch.is_tensor(template):
        return leaves[0]
    keys = sorted(template[0])
    return {k: leaves[i] for i, k in enumerate(keys)}, leaves[len(keys)]


def _all_gather_stacked(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Host data (the data loader's chunks) gathered on ``group``, a gloo control group: the buffers
    are host tensors (the default device), whatever device ``tensors`` name."""
    local = torch.stack(tensors).cpu()
    out = [torch.empty(local.shape, dtype=local.dtype) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, local, group=group)
    return [t for replica in out for t in replica.unbind(0)]


BUCKET_BYTES = 25 << 20
"""Gradients smaller than this are all-reduced together in buckets of at most this size (DDP's
default ``bucket_cap_mb``): one collective for many small tensors."""
BUCKETS_IN_FLIGHT = 2
"""Flattened buckets alive at once: a new one is flattened only once the oldest is summed and copied
back beyond this many (a bucket's sum overlaps the next one's flattening; the copies stay bounded by
``BUCKETS_IN_FLIGHT x bucket_bytes`` whatever the model, never the gradient's size)."""


@torch.no_grad()
def weighted_all_reduce_gradients(params: Iterable[torch.nn.Parameter], weight: float, group=None,
                                  bucket_bytes: int = BUCKET_BYTES) -> None:
    """``p.grad ← Σ_i w_i p.grad_i`` over the DP ``group`` (``weight`` = this group's ``m_i / M``).

    In place, without a flat copy of the gradients: the gradients are scaled in place by
    ``weight`` (``torch._foreach_mul_``, one fused kernel per device and dtype; nothing when the
    weight is 1, TorchTitan's DP *sum*), then summed over ``group`` — a gradient of at least
    ``bucket_bytes`` by one all-reduce in place, smaller ones of one dtype flattened into buckets of
    at most ``bucket_bytes``, as DDP buckets — the only copies, at most :data:`BUCKETS_IN_FLIGHT`
    buckets alive at once (the oldest is waited for and copied back before another is flattened), so
    a model of small gradients is never copied whole.  The in-place collectives are all issued before
    the first is waited for (on NCCL they are queued on the stream; on gloo they run in the
    background).  Parameters without a gradient contribute zeros (all ranks must agree on the
    parameter list).  DTensor parameters (FSDP2, as TorchTitan 0.3 applies it to
    every model part) contribute their local shards: ``group`` must be a replicate group (every member
    holds the same shard, as the DP replicas of FalconJob do: FSDP over the size-1 ``fsdp`` mesh), never
    the group a tensor is sharded over -- HSDP's replicate-dim reduction.
    """
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = _like(p, torch.zeros_like(_local(p)))
    grads = [_local(p.grad) for p in params]
    if weight != 1.0:
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            by_kind.setdefault((g.device, g.dtype), []).append(g)
        for same in by_kind.values():
            torch._foreach_mul_(same, weight)
    works, flattened = [], deque()
    for bucket in [*_buckets(grads, bucket_bytes), None]:  # None: the end
        if bucket is not None and len(bucket) == 1 and bucket[0].is_contiguous():
            works.append(dist.all_reduce(to_device(bucket[0], bucket[0].device), op=dist.ReduceOp.SUM,
                                         group=group, async_op=True))
            continue
        if bucket is None:
            for work in works:
                work.wait()  # NCCL: the current stream waits; gloo: the sum has landed
        while flattened and (bucket is None or len(flattened) >= BUCKETS_IN_FLIGHT):
            done, flat, summed = flattened.popleft()  # the oldest bucket's sum back into its gradients
            done.wait()
            offset = 0
            for g in summed:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            del done, flat, summed  # the work holds its tensor too: both freed before the next bucket
        if bucket is not None:
            flat = to_device(torch.cat([g.reshape(-1) for g in bucket]), bucket[0].device)  # device data
            flattened.append((dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True), flat,
                              bucket))


def _buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive gradients of one device and dtype, at most ``bucket_bytes`` together; a gradient
    of that size or more alone."""
    out: list[list[torch.Tensor]] = []
    open_: dict[tuple, tuple[list[torch.Tensor], int]] = {}
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if nbytes >= bucket_bytes:
            out.append([g])
            continue
        key = (g.device, g.dtype)
        bucket, size = open_.get(key, ([], 0))
        if bucket and size + nbytes > bucket_bytes:
            out.append(bucket)
            bucket, size = [], 0
        bucket.append(g)
        open_[key] = (bucket, size + nbytes)
    out.extend(b for b, _ in open_.values() if b)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: writes reach the DTensor); a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a gradient of ``param``: a DTensor of the same mesh and placements if it is one."""
    if hasattr(param, "to_local"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)
    return local


def weighted_all_reduce_loss(local_mean_loss: torch.Tensor, weight: float, group=None) -> torch.Tensor:
    """Global loss ``Σ_i w_i L_i`` (a detached tensor, the same on every rank of ``group``)."""
    t = to_device(local_mean_loss.detach().clone() * weight, local_mean_loss.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t
