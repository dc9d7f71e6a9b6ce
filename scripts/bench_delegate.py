#!/usr/bin/env python
"""Delegate data plane benchmark: delegate vs direct, side by side, in one invocation.

Measures (gloo on loopback, 2 ranks):
  1. throughput of a stream of messages rank 0 → rank 1, at 1 / 16 / 64 MB (target: delegate ≥ 0.8×
     direct at 16 MB);
  2. per-message one-way latency (one message in flight; both ranks stamp CLOCK_REALTIME of the same
     host: sender before the send call, receiver when the data is usable);
  3. end-to-end iteration time of a 2-stage PipeMorph, direct vs delegation="always", no straggler
     (target: overhead ≤ 5 %);
  4. on a CUDA machine only: D2H/H2D + signal bandwidth of the extension vs plain pinned
     cudaMemcpyAsync (target ≥ 0.8×); reported as "not run" elsewhere.

Prints a table and writes JSON (--json).  Usage:
    .venv/bin/python scripts/bench_delegate.py [--sizes-mb 1 16 64] [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _messages(size_mb: float, quick: bool) -> int:
    n = {1: 60, 16: 16, 64: 6}.get(int(size_mb), max(4, int(64 / max(size_mb, 1))))
    return max(3, n // 2) if quick else n


def _p2p_bench(rank, sizes_mb, quick, out):
    from titan_ext.runtime.comm.delegate import Channel, DelegatePool
    from titan_ext.runtime.comm.delegate.transport import P2PRouter

    max_bytes = int(max(sizes_mb) * (1 << 20))
    pool = DelegatePool(rank, [Channel(0, 1, "F")], num_slots=3, slot_bytes=max_bytes, timeout_s=300)
    router = P2PRouter(rank, pool)
    res = []
    try:
        for size_mb in sizes_mb:
            numel = int(size_mb * (1 << 20)) // 4
            n = _messages(size_mb, quick)
            src = torch.randn(numel)
            buf = torch.empty(numel)
            row = {"size_mb": size_mb, "messages": n}
            for path in ("direct", "delegate"):
                router.delegating = path == "delegate"
                # warm-up message (first-touch of buffers and slots)
                if rank == 0:
                    router.isend(src, 1, "F").wait()
                else:
                    router.irecv(buf, 0, "F").wait()
                # throughput: a stream of n messages
                dist.barrier()
                t0 = time.perf_counter()
                works = []
                for _ in range(n):
                    if rank == 0:
                        works.append(router.isend(src, 1, "F"))
                    else:
                        router.irecv(buf, 0, "F").wait()
                for w in works:
                    w.wait()
                if rank == 1:
                    row[f"{path}_MBps"] = n * size_mb / (time.perf_counter() - t0)
                dist.barrier()
                # latency: one message in flight at a time
                lat = []
                stamp = torch.zeros(1, dtype=torch.float64)
                for _ in range(max(3, n // 2)):
                    dist.barrier()
                    if rank == 0:
                        stamp[0] = time.time()
                        router.isend(src, 1, "F").wait()
                        dist.send(stamp, 1)
                    else:
                        router.irecv(buf, 0, "F").wait()
                        t_recv = time.time()
                        dist.recv(stamp, 0)
                        lat.append(1e3 * (t_recv - stamp.item()))
                if rank == 1:
                    row[f"{path}_latency_ms"] = statistics.median(lat)
            if rank == 1:
                row["throughput_ratio"] = row["delegate_MBps"] / row["direct_MBps"]
                row["latency_ratio"] = row["delegate_latency_ms"] / row["direct_latency_ms"]
                res.append(row)
        if rank == 1:
            st = [s for s in pool.stats() if s["kind"] == "recv-F"]
            out["per_delegate_MBps"] = st[0]["bytes_per_s"] / 1e6 if st else float("nan")
    finally:
        pool.close()
    out["p2p"] = res


def _e2e_bench(rank, quick, out):
    import torch.nn.functional as Fn
    from torch.distributed.pipelining import PipelineStage

    from titan_ext.runtime import PipeMorph
    from titan_ext.testing import mlp_stages, step_rank

    dim, batch, n_mb = 512, 256, 8
    steps, warm = (6, 2) if quick else (12, 3)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, dim, generator=g), torch.randn(batch, dim, generator=g)
    times = {}
    order = ["direct", "delegate", "direct", "delegate"]  # interleaved: drift on a shared host cancels
    for k, path in enumerate(order):
        mods = mlp_stages(2, dim, layers_per_stage=4, dtype=torch.float32)
        stage = PipelineStage(mods[rank], rank, 2, torch.device("cpu"))
        kw = dict(loss_fn=Fn.mse_loss, adaptive=False)
        sched = PipeMorph(stage, n_mb, **kw) if path == "direct" else PipeMorph(
            stage, n_mb, delegation="always", delegate_slot_bytes=4 << 20, **kw)
        its = []
        for s in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            step_rank(sched, rank, 2, x, y)
            its.append(1e3 * (time.perf_counter() - t0))
        times.setdefault(path, []).extend(its[warm:])
        if path == "delegate":
            sched.delegation.close()
    if rank == 0:
        d, g_ = statistics.median(times["direct"]), statistics.median(times["delegate"])
        out["e2e"] = {"direct_ms": d, "delegate_ms": g_, "overhead": g_ / d - 1.0,
                      "iterations_each": len(times["direct"]), "n_microbatches": n_mb,
                      "direct_all_ms": times["direct"], "delegate_all_ms": times["delegate"],
                      "activation_MB": batch * dim * 4 / n_mb / 1e6}


def _entry(rank, port, args, outdir):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=600))
    out = {}
    if not args.skip_p2p:
        _p2p_bench(rank, args.sizes_mb, args.quick, out)
    if not args.skip_e2e:
        _e2e_bench(rank, args.quick, out)
    with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def _gpu_bench(sizes_mb) -> dict:
    from titan_ext.runtime.comm.delegate import ring as R
    from titan_ext.runtime.comm.delegate._ext import cuda_available, load_ext

    if not cuda_available():
        return {"status": "not run: no CUDA GPU / extension built without CUDA"}
    ext = load_ext()
    rows = []
    for size_mb in sizes_mb:
        nbytes = int(size_mb * (1 << 20))
        ring = R.SlotRing.create(1, nbytes)
        ring.region.cuda_register()
        dev = torch.randn(nbytes // 4, device="cuda")
        pinned = torch.empty(nbytes // 4, pin_memory=True)
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        off = ring.geometry.slot_offset(0) + R.SLOT_PAYLOAD
        n = 20

        def timed(fn):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for k in range(n):
                fn(k)
            torch.cuda.synchronize()
            return n * nbytes / (time.perf_counter() - t0) / 1e9

        row = {"size_mb": size_mb}
        row["d2h_signal_GBps"] = timed(lambda k: ring.region.d2h_signal(dev, off, ring.state_offset(0), k + 1))
        row["d2h_memcpy_GBps"] = timed(lambda k: pinned.copy_(dev, non_blocking=True))
        row["h2d_signal_GBps"] = timed(lambda k: (ring.region.h2d_signal(off, dev, ring.state_offset(0), 0, flag, k + 1),
                                                  ext.stream_wait_flag(flag, k + 1)))
        row["h2d_memcpy_GBps"] = timed(lambda k: dev.copy_(pinned, non_blocking=True))
        row["d2h_ratio"] = row["d2h_signal_GBps"] / row["d2h_memcpy_GBps"]
        row["h2d_ratio"] = row["h2d_signal_GBps"] / row["h2d_memcpy_GBps"]
        rows.append(row)
    return {"status": "ok", "device": torch.cuda.get_device_name(), "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64])
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--quick", action="store_true", help="fewer messages / iterations")
    p.add_argument("--skip-p2p", action="store_true")
    p.add_argument("--skip-e2e", action="store_true")
    args = p.parse_args(argv)

    from titan_ext.testing import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_entry, args=(port, args, outdir), nprocs=2, join=True)
        merged = {}
        for r in range(2):
            with open(os.path.join(outdir, f"{r}.json")) as f:
                merged.update({k: v for k, v in json.load(f).items() if v})
    merged["gpu"] = _gpu_bench(args.sizes_mb)
    merged["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                         "loadavg": os.getloadavg(), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    merged["command"] = " ".join([os.path.basename(sys.executable), *sys.argv])

    print(f"\n{'size':>6} | {'direct MB/s':>11} | {'delegate MB/s':>13} | {'ratio':>5} | "
          f"{'direct lat ms':>13} | {'delegate lat ms':>15} | {'ratio':>5}")
    for r in merged.get("p2p", []):
        print(f"{r['size_mb']:>4g}MB | {r['direct_MBps']:>11.1f} | {r['delegate_MBps']:>13.1f} | "
              f"{r['throughput_ratio']:>5.2f} | {r['direct_latency_ms']:>13.2f} | {r['delegate_latency_ms']:>15.2f} | "
              f"{r['latency_ratio']:>5.2f}")
    if "per_delegate_MBps" in merged:
        print(f"per-delegate throughput (busy time only): {merged['per_delegate_MBps']:.1f} MB/s")
    if "e2e" in merged:
        e = merged["e2e"]
        print(f"end-to-end iteration (median of {e['iterations_each']}): direct {e['direct_ms']:.1f} ms, "
              f"delegation=always {e['delegate_ms']:.1f} ms, overhead {100 * e['overhead']:+.1f} %")
    g = merged["gpu"]
    if g.get("status") == "ok":
        for r in g["rows"]:
            print(f"GPU {r['size_mb']:g}MB: D2H+signal {r['d2h_signal_GBps']:.2f} GB/s vs memcpy "
                  f"{r['d2h_memcpy_GBps']:.2f} ({r['d2h_ratio']:.2f}x); H2D+signal {r['h2d_signal_GBps']:.2f} vs "
                  f"{r['h2d_memcpy_GBps']:.2f} ({r['h2d_ratio']:.2f}x)")
    else:
        print(f"GPU copy+signal: {g['status']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(merged, f, indent=2)
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
