#!/usr/bin/env python
"""Per-message latency of a test backend's P2P path: plain gloo vs ``nccl_rules``.

2 ranks on loopback.  Rank 0 sends ``--messages`` small tensors, one every ``--gap-ms``, stamping the
host clock at hand-over; rank 1 has each receive posted ahead (as the pipeline runtime does) and the
runtime's own ``ArrivalWatcher`` stamps its arrival (gloo: a blocking ``wait()`` in the watcher
thread; nccl_rules: ``is_completed()`` polling), then acknowledges it on a plain gloo group, so
each message meets an idle link (a stall does not queue the next ones behind it).  One host, one clock (``perf_counter`` is
CLOCK_MONOTONIC, shared by processes), so arrival − hand-over is the one-way latency the runtime's
link-delay estimator reads on an idle link.  ``--busy`` keeps the receiver's main thread in Python
bytecode between messages (compute holding the GIL), the case where a thread hop costs most.

    .venv/bin/python scripts/bench_p2p_latency.py --messages 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from titan_ext.testing import run_ranks  # noqa: E402


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _worker(rank: int, world: int, n: int, numel: int, gap_s: float, busy: bool) -> list[float]:
    from titan_ext.runtime.execute.device import ArrivalWatcher, RecvHandle, backend_waits_land, now

    host_wait = backend_waits_land(dist.get_backend())
    watcher = ArrivalWatcher()
    control = dist.new_group(backend="gloo")  # the pacing acks: plain gloo, off the measured path
    ack = torch.zeros(1)
    if rank == 0:
        payloads = [torch.full((numel,), float(k)) for k in range(n)]
        dist.barrier()
        stamps = []
        for data in payloads:
            time.sleep(gap_s)
            stamps.append(now())
            dist.isend(data, 1).wait()
            dist.recv(ack, 1, group=control)  # the link is idle again: each message meets an idle link
        dist.barrier()
        return stamps
    bufs = [torch.empty(numel) for _ in range(n)]
    handles = [watcher.watch(0, RecvHandle([dist.irecv(b, 0)], host_wait=host_wait)) for b in bufs]
    dist.barrier()  # every receive posted: the latency excludes the posting
    for h in handles:
        if busy:
            _spin(gap_s)
        h.done.wait()
        dist.send(ack, 0, group=control)
    for k, (h, b) in enumerate(zip(handles, bufs)):
        h.wait()
        assert float(b[0]) == k, (k, float(b[0]))
    watcher.close()
    dist.barrier()
    return [h.arrival for h in handles]


def measure(backend: str, n: int, numel: int, gap_ms: float, busy: bool) -> dict:
    sent, arrived = run_ranks(_worker, 2, n, numel, gap_ms / 1e3, busy, backend=backend)
    lat = sorted(1e3 * (a - s) for s, a in zip(sent, arrived))
    q = statistics.quantiles(lat, n=10)
    return {"backend": backend, "busy": busy, "messages": n, "median_ms": statistics.median(lat),
            "p10_ms": q[0], "p90_ms": q[-1], "max_ms": lat[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=200)
    ap.add_argument("--numel", type=int, default=256, help="float32 elements per message")
    ap.add_argument("--gap-ms", type=float, default=2.0)
    ap.add_argument("--backends", default="gloo,nccl_rules")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [measure(b, args.messages, args.numel, args.gap_ms, busy)
            for busy in (False, True) for b in args.backends.split(",")]
    for r in rows:
        print(f"{r['backend']:>10}  receiver {'busy' if r['busy'] else 'idle'}:  median {r['median_ms']:.3f} ms  "
              f"p10 {r['p10_ms']:.3f}  p90 {r['p90_ms']:.3f}  max {r['max_ms']:.3f}  ({r['messages']} messages)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
