"""Helpers of the delegate tests: run a function on N gloo ranks on loopback, collect results."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, outdir, args):
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        result = fn(rank, world, *args)
        err = None
    except BaseException as exc:  # noqa: BLE001
        result, err = None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump((result, err), f)
    if err is None:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # do not wait on abandoned direct receives at interpreter exit


def run_ranks(fn, world: int = 2, args: tuple = (), timeout_s: float = 240.0):
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; returns the per-rank results, raising
    the first rank's error if any rank failed."""
    port = free_port()
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_entry, args=(r, world, port, fn, outdir, args)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
                raise TimeoutError(f"rank process {p.pid} did not finish in {timeout_s} s")
        out = []
        for r in range(world):
            path = os.path.join(outdir, f"{r}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} died without a result (exit code {procs[r].exitcode})")
            with open(path, "rb") as f:
                out.append(pickle.load(f))
    return out
