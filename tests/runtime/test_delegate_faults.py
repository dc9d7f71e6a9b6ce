"""Delegate faults (gloo, loopback).

* A SIGKILL'd delegate (send side and receive side at once): its lane falls back to the direct path with
  no message lost or repeated, a new delegate is started in the background and the lane returns to it
  (docs/delegate.md "Killed delegate").  Checked with P2PRouter traffic whose every value names its
  sequence number, and in PipeMorph(delegation="always") training against direct PipeMorph (bit-equal) and torch's
  ScheduleGPipe (float64).
* With ``delegate_fallback=False``: the old clean stop on both ranks.
* A SIGKILL'd run leaves no shared memory and no delegate behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from titan_ext.testing import free_port, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

N_MB = 4
MAX_WAIT_S = 200.0   # for the respawned delegates to start on a busy machine (usually a few seconds)


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


def _pid(pool, kind):
    return [s for s in pool.stats() if s["kind"] == kind][0]["pid"]


def _all_returned(pool, kinds, dist):
    """Every rank agrees (one MIN all-reduce at this boundary) that its killed lanes are back."""
    import torch

    # (a schedule's pool starts at its first delegated op: None before the first step)
    back = {e["kind"] for e in pool.fallback_events if e["event"] == "returned"} if pool is not None else set()
    flag = torch.tensor([1.0 if set(kinds) <= back else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return flag.item() > 0


def _router_body(rank, world):
    import torch
    import torch.distributed as dist

    from titan_ext.runtime.comm.delegate import DelegatePool, pipeline_channels
    from titan_ext.runtime.comm.delegate.transport import P2PRouter

    pool = DelegatePool(rank, pipeline_channels(rank, [0, 1]), num_slots=4, slot_bytes=1 << 20, timeout_s=60)
    router = P2PRouter(rank, pool, delegating=True)
    got, victims, it, t0 = [], [], 0, time.monotonic()
    kinds = ["send-F", "recv-B"] if rank == 0 else ["recv-F", "send-B"]

    def iteration(k, with_b=True):
        for m in range(N_MB):
            if rank == 0:
                if k == 3 and m == 0:  # the send delegate holds each message 2 s: 12 and 13 stay undelivered
                    pool.set_link_delay_ms(1, "F", 2000.0)
                if k == 3 and m == 2:  # mid-iteration, two 256 KiB messages handed over, not delivered
                    victims.extend([_pid(pool, "send-F"), _pid(pool, "recv-B")])
                    for v in victims:
                        os.kill(v, signal.SIGKILL)
                router.isend(torch.full((1 << 16,), float(k * N_MB + m)), 1, "F")
            else:
                a = torch.empty(1 << 16)
                router.irecv(a, 0, "F").wait()
                assert bool((a == a[0]).all())
                got.append(int(a[0]))
        for m in range(N_MB if with_b else 0):
            if rank == 1:
                router.isend(torch.full((8,), float(k * N_MB + m)), 0, "B")
            else:
                g = torch.empty(8)
                router.irecv(g, 1, "B").wait()
                got.append(int(g[0]))

    while it < 6 or not _all_returned(pool, kinds, dist):
        assert time.monotonic() - t0 < MAX_WAIT_S, pool.fallback_events
        iteration(it)
        it += 1
        time.sleep(0.02)  # leave the CPU to the starting delegates
    for _ in range(3):  # traffic on the returned lanes
        iteration(it)
        it += 1
    stats = pool.stats()
    pool.close()
    return {"iterations": it, "got": got, "events": list(pool.fallback_events), "stats": stats,
            "victims": victims, "alive_after_close": [p for p in pool.pids() if _alive(p)]}


def test_killed_delegates_fall_back_exactly_and_return():
    (r0, e0), (r1, e1) = run_ranks(_router_body, 2, backend="gloo", timeout_s=500, outcomes=True)
    assert e0 is None and e1 is None, (e0, e1)
    n = r0["iterations"]
    assert r0["iterations"] == r1["iterations"]
    # every message exactly once, in order: F on rank 1, B on rank 0
    assert r1["got"] == list(range(n * N_MB))
    assert r0["got"] == list(range(n * N_MB))
    for r, kinds in ((r0, ("send-F", "recv-B")), (r1, ("recv-F", "send-B"))):
        by = {(e["kind"], e["event"]): e for e in r["events"]}
        for kind in kinds:
            assert {(kind, ev) for ev in ("fallback", "respawned", "returned")} <= set(by), r["events"]
        # after the return: both killed lanes up on a new delegate that carried traffic
        for s in r["stats"]:
            assert s["state"] == "up" and s["epoch"] == 1 and s["messages"] > 0, s
        assert r["alive_after_close"] == []
    # both ends agreed on the replay point and the switch-back point of each lane
    for send_kind, recv_side, recv_kind in (("send-F", r1, "recv-F"), ("recv-B", r1, "send-B")):
        a = {(e["event"]): e for e in r0["events"] if e["kind"] == send_kind}
        b = {(e["event"]): e for e in recv_side["events"] if e["kind"] == recv_kind}
        assert a["fallback"]["first_undelivered"] == b["fallback"]["first_undelivered"]
        assert a["returned"]["from_seq"] == b["returned"]["from_seq"]
    # the F lane died with messages 12, 13 handed over but not delivered: replayed on the direct path
    f_send = [e for e in r0["events"] if e["kind"] == "send-F" and e["event"] == "fallback"][0]
    first = f_send["first_undelivered"]
    assert first <= 3 * N_MB and f_send["replayed"] >= 3 * N_MB + 2 - first
    assert r0["victims"] and all(v not in r0["alive_after_close"] for v in r0["victims"])


DIM, BATCH = 8, 16


def _batch(step):
    from titan_ext.testing import seeded_batch

    return seeded_batch(1000 + step, BATCH, DIM)


def _train_body(rank, world):
    """PipeMorph(delegation="always") on a float64 MLP; rank 1 SIGKILLs its recv-F and send-B
    delegates inside the loss of microbatch 1 of step 2 (mid-iteration), training goes on until both
    ranks' lanes are back on new delegates, then the same number of steps runs with direct PipeMorph
    and torch's ScheduleGPipe."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as Fn
    from torch.distributed.pipelining import PipelineStage

    from titan_ext.runtime import PipeMorph
    from titan_ext.testing import gpipe_reference, mlp_stages, sgd_step, step_rank

    state = {"step": 0, "mb": 0, "victims": []}
    holder = {}

    def loss_fn(out, target):
        if state["step"] == 2 and state["mb"] == 1:
            pool = holder["sched"].delegation.pool
            state["victims"] = [_pid(pool, "recv-F"), _pid(pool, "send-B")]
            for v in state["victims"]:
                os.kill(v, signal.SIGKILL)
        state["mb"] += 1
        return Fn.mse_loss(out, target)

    def train(make, steps=None):
        mod = mlp_stages(world, DIM)[rank]
        sched = make(PipelineStage(mod, rank, world, torch.device("cpu")))
        opt = torch.optim.SGD(mod.parameters(), lr=0.05)
        losses, k, t0 = [], 0, time.monotonic()
        kinds = ["send-F", "recv-B"] if rank == 0 else ["recv-F", "send-B"]
        extra = 2  # steps on the returned lanes
        while (k < steps) if steps is not None else (k < 4 or extra > 0):
            assert time.monotonic() - t0 < MAX_WAIT_S
            if steps is None and _all_returned(sched.delegation.pool, kinds, dist):
                extra -= 1
            holder["sched"], state["step"], state["mb"] = sched, k, 0
            losses.append(sgd_step(sched, opt, rank, world, *_batch(k)))
            k += 1
            if steps is None and extra > 0:
                time.sleep(0.02)  # leave the CPU to the starting delegates
        return sched, losses, [p.detach().clone() for p in mod.parameters()]

    kw = dict(adaptive=False)
    sched, losses, params = train(lambda st: PipeMorph(st, N_MB, loss_fn=loss_fn, delegation="always", **kw))
    steps = len(losses)
    events, stats, counts = list(sched.delegation.pool.fallback_events), sched.delegation.pool.stats(), dict(sched.delegation.router.counts)
    sched.delegation.close()
    _, direct_losses, direct_params = train(lambda st: PipeMorph(st, N_MB, loss_fn=Fn.mse_loss, **kw), steps)

    def gpipe_step(ref, k):
        x, y = _batch(k)
        out: list = []
        step_rank(ref, rank, world, x, y, out)
        return [float(v) for v in out]

    gp_losses, gp_params = gpipe_reference(rank, world, N_MB, steps, gpipe_step, dim=DIM)
    return {"steps": steps, "losses": losses, "direct_losses": direct_losses, "gpipe_losses": gp_losses,
            "params_equal_direct": all(torch.equal(a, b) for a, b in zip(params, direct_params)),
            "params_close_gpipe": all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(params, gp_params)),
            "events": events, "stats": stats, "counts": counts, "victims": state["victims"]}


def test_killed_delegates_in_training_same_losses():
    (r0, e0), (r1, e1) = run_ranks(_train_body, 2, backend="gloo", timeout_s=500, outcomes=True)
    assert e0 is None and e1 is None, (e0, e1)
    assert len(r1["victims"]) == 2 and r0["steps"] == r1["steps"] >= 5
    # same losses as the undisturbed direct run (same plan: bit-equal) and as GPipe (float64)
    assert r1["losses"] == r1["direct_losses"] and len(r1["losses"][2]) == N_MB
    for a, b in zip(r1["losses"], r1["gpipe_losses"]):
        assert len(a) == len(b) == N_MB and all(abs(u - v) <= 1e-10 * max(1.0, abs(v)) for u, v in zip(a, b))
    for r, kinds in ((r0, ("send-F", "recv-B")), (r1, ("recv-F", "send-B"))):
        assert r["params_equal_direct"] and r["params_close_gpipe"]
        evs = {(e["kind"], e["event"]) for e in r["events"]}
        assert {(k, ev) for k in kinds for ev in ("fallback", "respawned", "returned")} <= evs, r["events"]
        assert all(s["state"] == "up" and s["epoch"] == 1 for s in r["stats"]), r["stats"]
        assert r["counts"]["direct"] == 0  # the router saw only delegate-path messages: fallback is inside


def _kill_body(rank, world):
    import torch

    from titan_ext.runtime.comm.delegate import DelegateError, DelegatePool, pipeline_channels
    from titan_ext.runtime.comm.delegate.transport import P2PRouter

    out = {"error": None}
    pool = DelegatePool(rank, pipeline_channels(rank, [0, 1]), num_slots=4, slot_bytes=1 << 20, timeout_s=30)
    out["pids"] = pool.pids()
    router = P2PRouter(rank, pool, delegating=True, delegate_fallback=False)
    received = []
    t_kill = None
    try:
        for k in range(200):
            if rank == 0:
                if k == 20:
                    victim = _pid(pool, "send-F")
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


def test_killed_delegate_without_fallback_stops_cleanly():
    res = run_ranks(_kill_body, 2, backend="gloo", timeout_s=240, outcomes=True)
    (r0, e0), (r1, e1) = res
    assert e0 is None and e1 is None, (e0, e1)
    assert r0["error"] is not None and "killed by signal 9" in r0["error"] and "send-F" in r0["error"]
    assert r0["error"].count("fallback is off") == 1
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
    from titan_ext.runtime.comm.delegate import DelegatePool, pipeline_channels
    from titan_ext.runtime.comm.delegate.transport import P2PRouter
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
    from titan_ext.runtime.comm.delegate import our_shm_names

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


HEARTBEAT_TIMEOUT_S = 3.0


def _frozen_body(rank, world):
    import torch
    import torch.distributed as dist

    from titan_ext.runtime.comm.delegate import DelegatePool, pipeline_channels
    from titan_ext.runtime.comm.delegate.transport import P2PRouter

    pool = DelegatePool(rank, pipeline_channels(rank, [0, 1]), num_slots=4, slot_bytes=1 << 20, timeout_s=60,
                        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    router = P2PRouter(rank, pool, delegating=True)
    got, frozen_pid, it, t0, t_stop = [], None, 0, time.monotonic(), None

    def iteration(k):
        nonlocal frozen_pid, t_stop
        for m in range(N_MB):
            if rank == 1 and k == 2 and m == 1:  # freeze this rank's recv-F delegate mid-iteration
                frozen_pid, t_stop = _pid(pool, "recv-F"), time.time()
                os.kill(frozen_pid, signal.SIGSTOP)
            if rank == 0:
                router.isend(torch.full((1 << 14,), float(k * N_MB + m)), 1, "F")
            else:
                a = torch.empty(1 << 14)
                router.irecv(a, 0, "F").wait()
                got.append(int(a[0]))

    kinds = ["send-F"] if rank == 0 else ["recv-F"]
    while it < 5 or not _all_returned(pool, kinds, dist):
        assert time.monotonic() - t0 < MAX_WAIT_S, pool.fallback_events
        iteration(it)
        it += 1
        time.sleep(0.02)
    iteration(it)
    it += 1
    events = list(pool.fallback_events)
    pool.close()
    return {"iterations": it, "got": got, "events": events, "frozen_pid": frozen_pid, "t_stop": t_stop,
            "alive_after_close": [p for p in pool.pids() if _alive(p)]}


def test_frozen_delegate_is_treated_like_a_dead_one():
    """A SIGSTOPped delegate (heartbeat stops) → killed and recovered: direct path, no message
    lost or repeated, a new delegate, nothing left running."""
    (r0, e0), (r1, e1) = run_ranks(_frozen_body, 2, backend="gloo", timeout_s=500, outcomes=True)
    assert e0 is None and e1 is None, (e0, e1)
    assert r1["got"] == list(range(r1["iterations"] * N_MB))
    fb = [e for e in r1["events"] if e["kind"] == "recv-F" and e["event"] == "fallback"]
    assert len(fb) == 1 and fb[0]["cause"].startswith("frozen"), r1["events"]
    # found by the heartbeat watchdog within its timeout plus the supervisor's tick and a busy machine
    assert fb[0]["time"] - r1["t_stop"] < HEARTBEAT_TIMEOUT_S + 15.0, (fb[0]["time"], r1["t_stop"])
    assert any(e["kind"] == "send-F" and e["event"] == "returned" for e in r0["events"]), r0["events"]
    assert not _alive(r1["frozen_pid"]) and r0["alive_after_close"] == [] and r1["alive_after_close"] == []
