"""Validation between iterations (Falcon §4.3): P2P ring passes and a GEMM probe.

Called collectively by every rank of the world at an iteration boundary (the "lightweight training
suspension": training simply does not start its next step until validation returns; no restart).

* :func:`validate_rings` — for every suspicious ring (a list of global ranks in ring order), runs the
  passes of :func:`~titan_ext.runtime.falcon.localize.ring_validation_passes` (even→odd, odd→even,
  one more for odd sizes); in each pass every pair sends a same-size tensor with blocking
  ``dist.send`` / ``dist.recv`` and the receiver times it. Rings are processed together pass by pass
  (passes of different rings may share ranks only if the rings do; such rings are run one after
  another). Returns ``{(src, dst): seconds}`` (fastest of the repeats) on every rank.
* :func:`gemm_probe` — every rank times an ``n × n`` matmul; returns ``{rank: seconds}`` on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .localize import ring_validation_passes

__all__ = ["validate_rings", "gemm_probe"]


def _all_gather_dict(local: dict, group=None) -> dict:
    world = dist.get_world_size(group)
    out: list = [None] * world
    dist.all_gather_object(out, local, group=group)
    merged: dict = {}
    for d in out:
        merged.update(d)
    return merged


def validate_rings(rings: Sequence[Sequence[int]], nbytes: int = 1 << 20, repeats: int = 3,
                   warmup: int = 1, group=None,
                   send_delay_s: Callable[[int, int], float] | None = None) -> dict[tuple[int, int], float]:
    """Time every directed ring link of ``rings`` (global ranks). Collective over ``group``.

    ``send_delay_s(src, dst)``: emulated extra latency of a message (the sender holds it back that
    long; :class:`~titan_ext.runtime.falcon.emulation.FailSlowEmulation`)."""
    rank = dist.get_rank()
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    # Build a schedule of passes; rings sharing ranks are serialised.
    schedule: list[list[tuple[int, int]]] = []
    used_per_slot: list[set[int]] = []
    for ring in rings:
        for i, p in enumerate(ring_validation_passes(list(ring))):
            members = {r for pair in p for r in pair}
            slot = i
            while slot < len(schedule) and used_per_slot[slot] & members:
                slot += 1
            while slot >= len(schedule):
                schedule.append([])
                used_per_slot.append(set())
            schedule[slot].extend(p)
            used_per_slot[slot] |= members
    samples: dict[tuple[int, int], list[float]] = {}
    for rep in range(warmup + repeats):
        for pass_pairs in schedule:
            dist.barrier(group=group)
            for src, dst in pass_pairs:
                if rank == src:
                    if send_delay_s is not None:
                        time.sleep(send_delay_s(src, dst))
                    dist.send(buf, dst)
                elif rank == dst:
                    t0 = time.perf_counter()
                    dist.recv(buf, src)
                    if rep >= warmup:
                        samples.setdefault((src, dst), []).append(time.perf_counter() - t0)
    # The fastest repeat, as in gemm_probe: a descheduled sender or receiver only ever adds time, while
    # a slow link is slow in every repeat.
    local = {k: min(v) for k, v in samples.items()}
    return _all_gather_dict(local, group)


def gemm_probe(n: int = 256, repeats: int = 5, group=None, dtype=torch.float32,
               stretch: Callable[[float], None] | None = None) -> dict[int, float]:
    """Fastest of ``repeats`` timings of an n×n matmul on every rank (Falcon §4.3 computation
    validation).  The minimum, not the median: preemption and time-sharing only ever add time, so a
    healthy device descheduled for some repeats still reads its own speed, while a slow device is slow
    in every repeat (on a shared 2-core host the median flagged healthy ranks at ≈ 1.1×).
    ``stretch(t0)``: called after each timed matmul (an emulated slow device sleeps there)."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        if stretch is not None:
            stretch(t0)
        times.append(time.perf_counter() - t0)
    return _all_gather_dict({dist.get_rank(): min(times)}, group)
