"""Delegate faults: a killed delegate stops training cleanly; SIGKILL'd runs leave no shared memory.

Killed-delegate behaviour (docs/delegate.md): **clean stop, no respawn**.  The rank whose delegate died
raises DelegateError naming the lane, pid and signal; its peer's delegate sees the Gloo connection
close and the peer raises DelegateError too; every delegate process is gone afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from _delegate_util import free_port, run_ranks

pytestmark = pytest.mark.slow


def _kill_body(rank, world):
    import torch

    from titan_ext.runtime.delegate import DelegateError, DelegatePool, pipeline_channels
    from titan_ext.runtime.delegate.transport import P2PRouter

    out = {"error": None}
    pool = DelegatePool(rank, pipeline_channels(rank, [0, 1]), num_slots=4, slot_bytes=1 << 20, timeout_s=30)
    out["pids"] = pool.pids()
    router = P2PRouter(rank, pool, delegating=True)
    received = []
    t_kill = None
    try:
        for k in range(200):
            if rank == 0:
                if k == 20:
                    victim = [s for s in pool.stats() if s["kind"] == "send-F"][0]["pid"]
                    out["victim"] = victim
                    t_kill = time.time()
                    os.kill(victim, signal.SIGKILL)
                    time.sleep(0.2)
                router.isend(torch.full((1024,), float(k)), 1, "F")
                g = torch.empty(4)
                router.irecv(g, 1, "B").wait()
            else:
                a = torch.empty(1024)
                router.irecv(a, 0, "F").wait()
                received.append(int(a[0]))
                router.isend(torch.full((4,), float(k)), 0, "B")
    except DelegateError as exc:
        out["error"] = str(exc)
        out["t_error"] = time.time()
    finally:
        out["t_kill"] = t_kill
        out["received"] = received
        pool.close()
        out["alive_after_close"] = [p for p in out["pids"] if _alive(p)]
    return out


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_killed_delegate_stops_training_cleanly():
    res = run_ranks(_kill_body, world=2, timeout_s=240)
    (r0, e0), (r1, e1) = res
    assert e0 is None and e1 is None, (e0, e1)
    assert r0["error"] is not None and "killed by signal 9" in r0["error"] and "send-F" in r0["error"]
    assert r0["error"].count("not respawned") == 1
    assert r1["error"] is not None and "recv-F" in r1["error"]          # the peer stops too
    assert r1["t_error"] - r0["t_kill"] < 30.0
    # nothing received out of order or twice before the stop
    assert r1["received"] == list(range(len(r1["received"])))
    assert r0["alive_after_close"] == [] and r1["alive_after_close"] == []


RUN_FOREVER = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist
    from datetime import timedelta
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    from titan_ext.runtime.delegate import DelegatePool, pipeline_channels
    from titan_ext.runtime.delegate.transport import P2PRouter
    pool = DelegatePool(rank, pipeline_channels(rank, [0, 1]), num_slots=4, slot_bytes=4 << 20)
    router = P2PRouter(rank, pool, delegating=True)
    k = 0
    while True:
        if rank == 0:
            router.isend(torch.randn(1 << 18), 1, "F")
            router.irecv(torch.empty(16), 1, "B").wait()
        else:
            router.irecv(torch.empty(1 << 18), 0, "F").wait()
            router.isend(torch.randn(16), 0, "B")
        k += 1
        if k == 50:
            with open(out + f".{rank}", "w") as f:
                f.write(" ".join(map(str, pool.pids())))
""")


def test_sigkill_leaves_no_shared_memory(tmp_path):
    from titan_ext.runtime.delegate import our_shm_names

    script = tmp_path / "run_forever.py"
    script.write_text(RUN_FOREVER)
    port = free_port()
    out = str(tmp_path / "pids")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), out]) for r in range(2)]
    try:
        deadline = time.time() + 200
        while not all(os.path.exists(f"{out}.{r}") for r in range(2)):
            assert time.time() < deadline, "the run did not reach steady state"
            assert all(p.poll() is None for p in procs), "a rank died early"
            time.sleep(0.2)
        time.sleep(0.5)
        trainer_pids = [p.pid for p in procs]
        delegate_pids = []
        for r in range(2):
            with open(f"{out}.{r}") as f:
                delegate_pids += [int(x) for x in f.read().split()]
        assert len(delegate_pids) == 4
        # while running: the segments are mapped but already nameless
        assert our_shm_names(trainer_pids) == []
        maps = open(f"/proc/{trainer_pids[0]}/maps").read()
        assert "titanx_" in maps and "(deleted)" in maps
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait(10)
        deadline = time.time() + 10
        while any(os.path.exists(f"/proc/{d}") and _alive(d) for d in delegate_pids):
            assert time.time() < deadline, "delegates outlived their SIGKILL'd training process"
            time.sleep(0.1)
        assert our_shm_names(trainer_pids + delegate_pids) == []
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
