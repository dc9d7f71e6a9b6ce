"""Bounded waits on peers (titan_ext.runtime.comm.timeouts), on two real gloo processes.

Reference facts, checked in docs/titan.md: gloo receives keep the timeout their group was created with
(``_set_pg_timeout`` does not change them), so without the wrapper a receive from a silent peer waits
the group's 30 min default here. With ``set_timeout(T)``:
(a) a PP receive through torch's ``schedules._batch_p2p`` ends after about T with ``PeerTimeout`` naming
    the silent peer (a running peer is not touched);
(b) a control-plane collective that one rank never enters ends after about T naming that rank;
(c) a *stopped* peer (SIGSTOP) on this host is killed by the rank that timed out on it, so that a
    launcher's SIGTERM (which a stopped process cannot act on) is not needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from titan_ext.testing import free_port, run_ranks

ROOT = Path(__file__).resolve().parents[2]
T = 2.0  # seconds: the timeout under test

SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    import torch, torch.distributed as dist
    from torch.distributed.pipelining import schedules
    from titan_ext.runtime.comm import timeouts
    from titan_ext.runtime.comm.control_plane import ControlPlane

    rank, port, out, T = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    timeouts.install_p2p_timeout()
    timeouts.set_timeout(T)
    timeouts.publish_identity()
    g_p2p = timeouts.new_group([0, 1], None, backend="gloo")
    g_fence = timeouts.new_group([0, 1], None, backend="gloo")
    cp = ControlPlane(None)
    dist.barrier()
    res = {}

    def timed(name, fn):
        t0 = time.monotonic()
        try:
            fn()
            res[name] = {"error": None}
        except timeouts.PeerTimeout as e:
            res[name] = {"error": str(e)}
        res[name]["s"] = time.monotonic() - t0

    if rank == 0:
        buf = torch.zeros(4)
        recv = lambda g: schedules._wait_batch_p2p(schedules._batch_p2p([dist.P2POp(dist.irecv, buf, 1, g)]))
        timed("p2p", lambda: recv(g_p2p))                      # (a) rank 1 waits in a barrier, never sends
        dist.barrier()
        timed("control", lambda: cp.all_gather(torch.ones(2)))  # (b) rank 1 never joins
        dist.barrier()
        timed("fence", lambda: recv(g_fence))                  # (c) rank 1 stops itself
        time.sleep(0.5)
        res["peer_state"] = timeouts._state(int(sys.argv[5])) if len(sys.argv) > 5 else None
        with open(out, "w") as f:
            json.dump(res, f)
        os._exit(0)
    else:
        dist.barrier()        # (a) silent but running: never sends
        dist.barrier()        # (b) never enters the all_gather
        os.kill(os.getpid(), signal.SIGSTOP)  # (c) frozen; rank 0 must kill it
        os._exit(3)
""")


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_silent_and_stopped_peers_end_within_the_timeout_and_are_named(tmp_path):
    script = tmp_path / "peer.py"
    script.write_text(SCRIPT)
    out = tmp_path / "result.json"
    port = str(free_port())
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    peer = subprocess.Popen([sys.executable, str(script), "1", port, str(out), str(T)], env=env)
    try:
        main = subprocess.run([sys.executable, str(script), "0", port, str(out), str(T), str(peer.pid)],
                              env=env, capture_output=True, text=True, timeout=150)
        assert main.returncode == 0, main.stderr[-3000:]
        peer_code = peer.wait(timeout=30)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
    res = json.loads(out.read_text())
    # (a) a silent running peer: named, not killed, after about T (not gloo's 30 min)
    assert res["p2p"]["error"] and "rank 1 stopped answering" in res["p2p"]["error"], res
    assert "killed" not in res["p2p"]["error"]
    assert T * 0.9 <= res["p2p"]["s"] < T + 30, res  # (gloo's own: the group's 30 min)
    # (b) the control plane names the rank that never arrived
    assert res["control"]["error"] and "rank(s) [1] stopped answering" in res["control"]["error"], res
    assert T * 0.9 <= res["control"]["s"] < T + 30, res
    # (c) a stopped peer is fenced: killed by rank 0 (SIGKILL), not left for a launcher
    assert res["fence"]["error"] and "killed it" in res["fence"]["error"], res
    assert peer_code == -9, peer_code


def test_timeout_values_are_checked():
    from titan_ext.runtime.comm import timeouts

    for bad in (0, -1, float("nan"), float("inf"), "30", True):
        with pytest.raises(ValueError, match="timeout"):
            timeouts.set_timeout(bad)


def _count_pp_waits(rank: int, world: int, train_s: float) -> dict:
    """Two steps of torch's 1F1B with the timeouts a TorchTitan job installs (registry._install_timeouts,
    then the train timeout after the first step); every PP message wait counted as the backend sees it."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, schedules

    from titan_ext.runtime.comm import timeouts
    from titan_ext.testing import mlp_stages, seeded_batch, step_rank

    counts = {"waits": 0, "with_timeout": 0}

    class Counted:
        def __init__(self, work):
            self.work = work

        def wait(self, timeout=None):
            counts["waits"] += 1
            counts["with_timeout"] += timeout is not None
            return self.work.wait() if timeout is None else self.work.wait(timeout)

        def __getattr__(self, name):
            return getattr(self.work, name)

    batch_p2p = schedules._batch_p2p
    schedules._batch_p2p = lambda ops, desc=None: [Counted(w) for w in batch_p2p(ops, desc)]
    timeouts.set_timeout(300.0)  # comm.init_timeout_seconds
    timeouts.install_p2p_timeout()
    pp_group = dist.new_group()
    stage = PipelineStage(mlp_stages(world)[rank], rank, world, torch.device("cpu"), group=pp_group)
    schedule = Schedule1F1B(stage, 4, loss_fn=nn.functional.mse_loss)
    x, y = seeded_batch(0, 8, 16)
    for step in range(3):
        step_rank(schedule, rank, world, x, y)
        if step == 0:
            timeouts.set_timeout(train_s)  # comm.train_timeout_seconds, after the first step
    counts["backend"] = dist.get_backend(pp_group)
    counts["group_timeout_s"] = getattr(pp_group, "timeout_s", None)
    return counts


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["nccl_rules", "gloo"])
def test_pp_waits_pass_a_timeout_only_where_the_backend_needs_it(backend):
    """On NCCL a PP wait with a timeout busy-waits the host (ProcessGroupNCCL's blocking wait): under the
    NCCL-like backend no PP message wait passes one, and the PP group's own timeout (NCCL's watchdog)
    follows set_timeout.  On gloo, whose receives keep their creation timeout, every wait passes it."""
    seen = run_ranks(_count_pp_waits, 2, 7.0, backend=backend, timeout_s=100)
    for counts in seen:
        assert counts["backend"] == backend and counts["waits"] >= 8, counts
        if backend == "gloo":
            assert counts["with_timeout"] == counts["waits"], counts
        else:
            assert counts["with_timeout"] == 0, counts
            assert counts["group_timeout_s"] == 7.0, counts


NCCL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import torch, torch.distributed as dist
    from torch.distributed.pipelining import schedules
    from titan_ext.runtime.comm import timeouts
    from titan_ext.testing.nccl_rules import install

    rank, port, T, where = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4]
    install()
    dist.init_process_group("nccl_rules", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    timeouts.install_p2p_timeout()
    timeouts.set_timeout(T)
    timeouts.publish_identity()
    pp = timeouts.new_group([0, 1], None)  # the PP group, its timeout T (TorchTitan sets every group's)
    if where != "first":  # the PP communicator, made by the path the waits below take (under lazy init the
        # first op makes it, blocking the host: torch <= 2.11 sends a lone op through batch_isend_irecv, the
        # group's communicator; later torch as a bare op, the pair's)
        op = dist.P2POp(dist.isend if rank == 0 else dist.irecv, torch.zeros(1), 1 - rank, pp)
        schedules._wait_batch_p2p(schedules._batch_p2p([op]))
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: rank 0's watch kills it, NCCL's watchdog ends rank 0
        os._exit(3)
    buf = torch.zeros(4)
    if where in ("p2p", "first"):  # "first": the issue itself blocks, in communicator creation
        schedules._wait_batch_p2p(schedules._batch_p2p([dist.P2POp(dist.irecv, buf, 1, pp)]))
        print("wait returned", flush=True)
        buf.sum()  # the consumer: waits on the stream until the watchdog ends the process
    else:  # a collective of ours on the PP group (as the pipeline monitor's gather): blocks until the watchdog
        # (an all-reduce: torch 2.15's all_gather_object asks a Python process group for a per-device backend)
        timeouts.named(pp, "pipeline monitor", lambda: dist.all_reduce(torch.ones(1), group=pp))
    os._exit(0)
""")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["p2p", "first", "collective"])
def test_a_frozen_peer_ends_the_job_within_the_timeout_under_the_nccl_like_backend(where, tmp_path):
    """No explicit wait timeout on NCCL: the PP group's timeout and the watchdog end rank 0 (SIGABRT, as
    ProcessGroupNCCL's watchdog), after the watch named and killed the stopped peer — whether rank 0
    waits for it in a PP message, blocks in issuing its first PP op (lazy init: the op creates the
    communicator, and no work exists yet — the watch missed it before it watched the issue), or waits
    in a named collective on the PP group (which raises nothing there: before the watch covered it,
    the stopped peer was neither named nor killed)."""
    script = tmp_path / "peer.py"
    script.write_text(NCCL_SCRIPT)
    port = str(free_port())
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    env.pop("TITAN_EXT_NCCL_RULES_WATCHDOG", None)
    peer = subprocess.Popen([sys.executable, str(script), "1", port, str(T), where], env=env)
    try:
        import time

        t0 = time.monotonic()
        main = subprocess.run([sys.executable, str(script), "0", port, str(T), where], env=env,
                              capture_output=True, text=True, timeout=100)
        took = time.monotonic() - t0
        peer_code = peer.wait(timeout=30)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
    if where == "p2p":
        assert main.returncode == -6, (main.returncode, main.stderr[-3000:])  # NCCL's watchdog: SIGABRT
        assert "wait returned" in main.stdout  # wait() did not block the host
        assert "rank 1 stopped answering" in main.stderr, main.stderr[-3000:]
    elif where == "first":  # the watchdog's SIGABRT, or the creation's error once its peer was killed (exit 1)
        assert main.returncode in (-6, 1), (main.returncode, main.stderr[-3000:])
        assert "wait returned" not in main.stdout  # the issue blocked (communicator creation)
        assert "issuing a PP op with rank(s) [1]" in main.stderr, main.stderr[-3000:]
        assert "rank(s) [1] stopped answering" in main.stderr, main.stderr[-3000:]
    else:  # the watchdog's SIGABRT, or the error of the collective its killed peer left (exit 1)
        assert main.returncode in (-6, 1), (main.returncode, main.stderr[-3000:])
        assert "pipeline monitor over ranks [0, 1]" in main.stderr, main.stderr[-3000:]
        assert "rank(s) [1] (its process" in main.stderr, main.stderr[-3000:]
    assert "killed it" in main.stderr, main.stderr[-3000:]
    assert "NCCL rules" in main.stderr, main.stderr[-3000:]  # the watchdog, or the dead peer's error
    assert peer_code == -9, peer_code
    assert took < T + 30, took


# ---------------------------------------------------------------- the watch's device, NCCL's rules
def test_the_watch_polls_under_the_device_of_the_thread_that_registered_the_work(monkeypatch):
    """Defect: the watch thread polled ``Work.is_completed()`` — on NCCL a ``cudaEventQuery`` —
    from a thread that never selected a device: CUDA then opens a context on GPU 0 in every process.
    Each work now carries its registering thread's device (``device.thread_device()``), entered around
    every poll.  A simulated device per thread (a thread-local "current device") stands in for CUDA's."""
    import contextlib
    import threading
    import time

    from titan_ext.runtime.execute import device
    from titan_ext.runtime.comm import timeouts

    current = threading.local()

    def thread_device():  # device.thread_device's simulation: the calling thread's device, as a factory
        dev = getattr(current, "device", None)

        @contextlib.contextmanager
        def enter():
            before = getattr(current, "device", None)
            current.device = dev
            try:
                yield
            finally:
                current.device = before

        return enter

    queries = []

    class Work:  # an NCCL-like receive: is_completed() is a device call
        def is_completed(self):
            queries.append((threading.current_thread().name, getattr(current, "device", None)))
            return len(queries) >= 2

        def wait(self, timeout=None):  # noqa: ARG002 - a stream wait: returns at once
            return True

    monkeypatch.setitem(device._SIMULATED, "thread_device", thread_device)
    monkeypatch.setattr(timeouts, "_timeout_s", 60.0)
    current.device = "cuda:3"  # the training thread's (TorchTitan's torch.cuda.set_device)
    try:
        timeouts._TimedWork(Work(), 1, "receive", explicit=False).wait()
    finally:
        current.device = None
    deadline = time.monotonic() + 30.0
    while len(queries) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(queries) >= 2, queries
    assert all(name == "titan_ext-pp-watch" and dev == "cuda:3" for name, dev in queries), queries


def _watch_under_the_lagging_device(rank: int, world: int) -> dict:
    """A PP message (torch's _batch_p2p, timed as in every TorchTitan job) under the NCCL-like backend and
    the simulated device that runs behind the host (its current device per thread)."""
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    from titan_ext.runtime.comm import timeouts
    from titan_ext.testing import lagdevice

    dev = lagdevice.install()
    polls = []
    done = timeouts._TimedWork.done
    timeouts._TimedWork.done = lambda self: polls.append(1) or done(self)
    try:
        timeouts.install_p2p_timeout()
        timeouts.set_timeout(60.0)
        buf = torch.ones(4) if rank == 0 else torch.zeros(4)
        op = dist.P2POp(dist.isend if rank == 0 else dist.irecv, buf, 1 - rank)
        schedules._wait_batch_p2p(schedules._batch_p2p([op]))
        deadline = time.monotonic() + 20.0
        while not polls and time.monotonic() < deadline:  # the watch polls every 0.25 s
            time.sleep(0.05)
        time.sleep(0.5)
        return {"polls": len(polls), "violations": [v for v in dev.violations if "pp-watch" in v]}
    finally:
        timeouts._TimedWork.done = done
        lagdevice.uninstall()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_watch_makes_no_device_call_without_the_ranks_device_under_the_lagging_device():
    """The same defect under ``nccl_rules`` and ``testing/lagdevice.py``: the watch thread's
    ``Work.is_completed()`` polls are device calls, each made from a thread that never selected the
    rank's device on the old code (one violation per poll: a context on GPU 0 on a GPU)."""
    res = run_ranks(_watch_under_the_lagging_device, 2, backend="nccl_rules", timeout_s=100)
    for r in res:
        assert r["polls"] >= 1, r  # the watch polled (not vacuous)
        assert r["violations"] == [], r["violations"]


def test_a_group_whose_backend_cannot_be_told_gets_no_explicit_wait_timeout(monkeypatch):
    """Defect: ``explicit_wait_timeout`` returned True when ``get_backend`` raised, i.e. an
    explicit ``wait(timeout)`` — on NCCL a busy-wait of the host at every PP wait.  It fails closed now."""
    import torch.distributed as dist

    from titan_ext.runtime.comm import timeouts

    for var in ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"):
        monkeypatch.delenv(var, raising=False)

    def unknown(group=None):  # noqa: ARG001
        raise ValueError("Invalid process group specified")

    monkeypatch.setattr(dist, "get_backend", unknown)
    assert timeouts.explicit_wait_timeout(object()) is False
    for backend, explicit in (("gloo", True), ("nccl", False), ("nccl_rules", False), ("cuda:nccl,cpu:gloo", False)):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: dist.Backend(b))
        assert timeouts.explicit_wait_timeout(None) is explicit, backend


def test_nccl_blocking_wait_is_detected_and_named_once(monkeypatch, caplog):
    """Defect: with ``TORCH_NCCL_BLOCKING_WAIT=1`` every PP wait blocks the host (ProcessGroupNCCL's
    blocking wait) and the watchdog no longer aborts; nothing said so.  Installing the PP timeouts now
    warns once, naming the variable and its cost, and NCCL waits get the explicit timeout there (they
    block anyway; the timeout then names the peer).  Read as c10d's getCvarBool reads it."""
    import logging

    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    from titan_ext.runtime.comm import timeouts

    for var in timeouts.BLOCKING_WAIT_VARS:
        monkeypatch.delenv(var, raising=False)
    assert not timeouts.blocking_wait()
    monkeypatch.setenv("NCCL_BLOCKING_WAIT", "1")  # the deprecated alias
    assert timeouts.blocking_wait()
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "0")  # the first name wins
    assert not timeouts.blocking_wait()
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "True")
    assert timeouts.blocking_wait()
    for backend, explicit in (("nccl", True), ("cuda:nccl,cpu:gloo", True), ("nccl_rules", False)):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: dist.Backend(b))
        assert timeouts.explicit_wait_timeout(None) is explicit, backend
    monkeypatch.setattr(timeouts, "_warned_blocking_wait", [])
    monkeypatch.setattr(schedules, "_batch_p2p", schedules._batch_p2p)  # restored after the test
    with caplog.at_level(logging.WARNING, logger="titan_ext.runtime.comm.timeouts"):
        timeouts.install_p2p_timeout()
        timeouts.install_p2p_timeout()
    lines = [r.getMessage() for r in caplog.records if "BLOCKING_WAIT" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "TORCH_NCCL_BLOCKING_WAIT=True" in lines[0] and "GPU idles at every PP wait" in lines[0], lines


def test_a_works_timeout_is_fixed_when_it_is_created(monkeypatch):
    """As ProcessGroupNCCL fixes a work's timeout at its creation: a wait created under the init
    timeout keeps it after the switch to the train timeout."""
    from datetime import timedelta

    from titan_ext.runtime.comm import timeouts

    limits = []

    class Work:
        def wait(self, timeout=None):
            limits.append(timeout)
            return True

    monkeypatch.setattr(timeouts, "_timeout_s", 300.0)
    work = timeouts._TimedWork(Work(), 1, "receive", explicit=True)
    monkeypatch.setattr(timeouts, "_timeout_s", 1.0)
    work.wait()
    timeouts._TimedWork(Work(), 1, "receive", explicit=True).wait()
    assert limits == [timedelta(seconds=300.0), timedelta(seconds=1.0)]


def _train_timeout_switch(rank: int, world: int) -> dict:
    """TorchTitan's rule: the init timeout until the first step is done, then the train timeout. Rank 1
    finishes its first step 4 s after rank 0 (legitimately, under the 60 s init timeout); then both run
    a collective on one of our groups."""
    import time

    import torch
    import torch.distributed as dist

    from titan_ext.runtime.comm import timeouts

    timeouts.set_timeout(60.0)  # comm.init_timeout_seconds
    group = timeouts.new_group(None, None, backend="gloo")
    dist.barrier()
    if rank == 1:
        time.sleep(4.0)
    t0 = time.monotonic()
    timeouts.set_timeout(1.0)  # comm.train_timeout_seconds, after the first step
    switch_s = time.monotonic() - t0
    value = torch.ones(1)
    try:
        dist.all_reduce(value, group=group)
        error = None
    except RuntimeError as exc:
        error = str(exc)[:400]
    return {"switch_s": switch_s, "error": error, "sum": value.item()}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_switch_to_a_shorter_timeout_waits_for_every_rank():
    """Defect: each rank moved to the train timeout on its own; the fast rank's next
    collective, created under the 1 s timeout, timed out on the slow rank still finishing its first
    step.  The switch now waits for every rank (a barrier in the store, as TorchTitan's set_pg_timeouts
    does before its _set_pg_timeout), so the collective succeeds."""
    res = run_ranks(_train_timeout_switch, 2, backend="gloo", timeout_s=100)
    assert [r["error"] for r in res] == [None, None], res
    assert [r["sum"] for r in res] == [2.0, 2.0], res
    assert res[0]["switch_s"] >= 2.0, res  # rank 0 waited for rank 1 (4 s late)


def _switch_without_a_peer(rank: int, world: int) -> dict:
    import time

    import torch.distributed as dist

    from titan_ext.runtime.comm import timeouts

    timeouts.set_timeout(2.0)
    dist.barrier()
    out = {"error": None, "s": 0.0}
    if rank == 0:  # rank 1 never reaches the switch
        t0 = time.monotonic()
        try:
            timeouts.set_timeout(1.0)
        except timeouts.PeerTimeout as exc:
            out["error"] = str(exc)
        out["s"] = time.monotonic() - t0
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_rank_that_never_reaches_the_switch_is_named_within_the_old_timeout():
    res = run_ranks(_switch_without_a_peer, 2, backend="gloo", timeout_s=100)
    assert res[0]["error"] and "rank(s) [1] stopped answering" in res[0]["error"], res
    assert 1.8 <= res[0]["s"] < 30.0, res
