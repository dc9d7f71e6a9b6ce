"""Validation between iterations (Falcon §4.3): P2P ring passes and a GEMM probe.

Called collectively by every rank of the world at an iteration boundary (the "lightweight training
suspension": training simply does not start its next step until validation returns; no restart).

* :func:`validate_trees` — the same for tree communicators (four passes,
  :func:`~titan_ext.runtime.falcon.localize.tree_validation_passes`); both are
  :func:`validate_passes` over their communicators' passes.
* :func:`validate_rings` — for every suspicious ring (a list of global ranks in ring order), runs the
  passes of :func:`~titan_ext.runtime.falcon.localize.ring_validation_passes` (even→odd, odd→even,
  one more for odd sizes); in each pass every pair sends a same-size tensor as a batched P2P op on
  the ring's own group (``comms``) and the receiver times it. Rings are processed together pass by pass
  (passes of different rings may share ranks only if the rings do; such rings are run one after
  another). Returns ``{(src, dst): seconds}`` (fastest of the repeats) on every rank.
* :func:`gemm_probe` — every rank times an ``n × n`` matmul; returns ``{rank: seconds}`` on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .device_clock import DeviceTimer, device_buffer, device_sleep, ensure_communicator
from .localize import ring_validation_passes, tree_validation_passes

__all__ = ["validate_rings", "validate_trees", "validate_passes", "gemm_probe"]


def _all_gather_dict(local: dict, group=None) -> dict:
    world = dist.get_world_size(group)
    out: list = [None] * world
    dist.all_gather_object(out, local, group=group)
    merged: dict = {}
    for d in out:
        merged.update(d)
    return merged


def validate_rings(rings: Sequence[Sequence[int]], nbytes: int = 1 << 20, **kw) -> dict[tuple[int, int], float]:
    """Time every directed ring link of ``rings`` (global ranks; passes of
    :func:`~.localize.ring_validation_passes`). Collective; ``kw`` as :func:`validate_passes`."""
    return validate_passes([ring_validation_passes(list(r)) for r in rings], nbytes, **kw)


def validate_trees(trees: Sequence[Sequence[int]], nbytes: int = 1 << 20, both_directions: bool = False,
                   **kw) -> dict[tuple[int, int], float]:
    """Time every child → parent link (and parent → child with ``both_directions``) of ``trees``
    (global ranks in heap order; the four passes of :func:`~.localize.tree_validation_passes`,
    Falcon §4.3 Fig. 9 right). Collective; ``kw`` as :func:`validate_passes`."""
    return validate_passes([tree_validation_passes(list(t), both_directions) for t in trees], nbytes, **kw)


def validate_passes(groups: Sequence[list[list[tuple[int, int]]]], nbytes: int = 1 << 20, repeats: int = 3,
                    warmup: int = 1, group=None,
                    send_delay_s: Callable[[int, int], float] | None = None,
                    device=None, comms: Sequence | None = None) -> dict[tuple[int, int], float]:
    """Time every directed link of ``groups`` (per communicator, its validation passes of
    ``(src, dst)`` global-rank pairs). Collective over ``group``.

    The messages are device buffers (``device``; CPU by default) sent with global ranks as batched
    P2P ops (``batch_isend_irecv``) on each communicator's process group: ``comms[i]`` (``comms``
    None: the default group for all; an entry None: a communicator this rank is not in); the receiver's time is the message's *completion* (device timer
    marks around the receive, read once it has landed). ``group`` (a gloo control group on a GPU
    job) carries the barriers between passes and the gathered results.

    Why batched ops on the ring's group (Falcon §4.3 measures the link a collective uses, device to
    device, so the passes stay on the data groups): ProcessGroupNCCL's ``pointToPoint`` runs a
    *bare* ``send``/``recv`` on a two-rank communicator of the pair, made at the pair's first op
    (``getKeySendRecv``: a blocking rendezvous of the two ranks and a new communicator's device
    memory, here at the moment of diagnosis), and a *batched* one on the group's own communicator
    ("treat it like a collective when selecting communicator").  A group's communicator exists once
    every member ran a collective on it: :func:`~.device_clock.ensure_communicator` (a no-op for the
    groups a job warmed at start-up — FalconJob warms its PP and DP groups) runs first, for the
    groups this rank is in, in ring order (no wait cycle: a chain of waits goes to earlier rings).
    ``send_delay_s(src, dst)``: emulated extra latency of a message (the sender's stream holds it
    back that long: :func:`~.device_clock.device_sleep`;
    :class:`~titan_ext.runtime.falcon.emulation.FailSlowEmulation`)."""
    rank = dist.get_rank()
    comms = [dist.group.WORLD] * len(groups) if comms is None else (list(comms) + [None] * len(groups))[:len(groups)]
    for passes, comm in zip(groups, comms):
        if comm is None:  # a ring of other ranks (each rank names the groups of its own rings)
            if any(rank in pair for p in passes for pair in p):
                raise ValueError(f"validation: rank {rank} is in a ring with no process group: {passes}")
            continue
        if rank in dist.get_process_group_ranks(comm):
            ensure_communicator(comm, device)
    buf = device_buffer(max(1, nbytes // 4), device)
    timer = DeviceTimer(device)
    samples: dict[tuple[int, int], list[float]] = {}
    for rep in range(warmup + repeats):
        for pass_pairs in _pass_schedule(groups, comms):
            dist.barrier(group=group)
            for src, dst, comm in pass_pairs:
                if rank == src:
                    if send_delay_s is not None:
                        device_sleep(send_delay_s(src, dst), device)
                    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, dst, group=comm)]):
                        work.wait()
                elif rank == dst:
                    start = timer.mark()
                    seconds = timer.completion_s(start, dist.batch_isend_irecv(
                        [dist.P2POp(dist.irecv, buf, src, group=comm)]))
                    if rep >= warmup:
                        samples.setdefault((src, dst), []).append(seconds)
    # The fastest repeat, as in gemm_probe: a descheduled sender or receiver only ever adds time, while
    # a slow link is slow in every repeat.
    local = {k: min(v) for k, v in samples.items()}
    return _all_gather_dict(local, group)


def _pass_schedule(groups: Sequence[list[list[tuple[int, int]]]], comms: Sequence) -> list[list[tuple]]:
    """The passes of every communicator (§4.3) run together, those sharing ranks serialised pass by
    pass; each pair with its communicator's group, ``(src, dst, group)``."""
    schedule: list[list[tuple]] = []
    used_per_slot: list[set[int]] = []
    for passes, comm in zip(groups, comms):
        for i, p in enumerate(passes):
            members = {r for pair in p for r in pair}
            slot = i
            while slot < len(schedule) and used_per_slot[slot] & members:
                slot += 1
            while slot >= len(schedule):
                schedule.append([])
                used_per_slot.append(set())
            schedule[slot].extend((src, dst, comm) for src, dst in p)
            used_per_slot[slot] |= members
    return schedule


def gemm_probe(n: int = 256, repeats: int = 5, group=None, dtype=torch.float32,
               slowdown: Callable[[], float] | None = None, device=None) -> dict[int, float]:
    """Fastest of ``repeats`` timings of an n×n matmul on every rank's ``device`` (Falcon §4.3
    computation validation), timed with device timer marks (CUDA events on a GPU), gathered over
    ``group`` (a gloo control group on a GPU job). The minimum, not the median: preemption and
    time-sharing only ever add time, so a healthy device descheduled for some repeats still reads
    its own speed, while a slow device is slow in every repeat (on a shared 2-core host the median
    flagged healthy ranks at ≈ 1.1×).
    ``slowdown()``: an emulated slow device's factor F; each timed matmul is followed, inside the
    timed region, by a device-side delay of (F - 1) × the matmul's time (on CPU the matmul just
    measured; on CUDA the warm-up's, as the device has not finished the matmul when it is enqueued)."""
    a = torch.randn(n, n, dtype=dtype, device=device)  # made on the device: no host-to-device copy
    b = torch.randn(n, n, dtype=dtype, device=device)
    timer = DeviceTimer(device)
    start = timer.mark()
    torch.mm(a, b)  # warm-up
    warm_s = timer.elapsed_s(start, timer.mark())
    times = []
    for _ in range(repeats):
        start = timer.mark()
        torch.mm(a, b)
        factor = slowdown() if slowdown is not None else 1.0
        if factor > 1.0:
            mm_s = warm_s if timer.cuda else time.perf_counter() - start
            device_sleep((factor - 1.0) * mm_s, device)
        times.append(timer.elapsed_s(start, timer.mark()))
    return _all_gather_dict({dist.get_rank(): min(times)}, group)
