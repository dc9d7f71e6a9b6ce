"""Bounded waits on peers (issue 26, titan_ext.runtime.timeouts), on two real gloo processes.

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
import time
from pathlib import Path

import pytest

from titan_ext.runtime.testing import free_port

ROOT = Path(__file__).resolve().parent.parent
T = 2.0  # seconds: the timeout under test

SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    import torch, torch.distributed as dist
    from torch.distributed.pipelining import schedules
    from titan_ext.runtime import timeouts
    from titan_ext.runtime.control import ControlPlane

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
        timed("p2p", lambda: recv(g_p2p))                      # (a) rank 1 sleeps, never sends
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
        time.sleep(T * 2.5)   # (a) silent but running
        dist.barrier()
        time.sleep(T * 2.5)   # (b) never enters the all_gather
        dist.barrier()
        os.kill(os.getpid(), signal.SIGSTOP)  # (c) frozen; rank 0 must kill it
        os._exit(3)
""")


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
    assert T * 0.9 <= res["p2p"]["s"] < T * 2.4, res  # rank 1 stays silent for 2.5 T
    # (b) the control plane names the rank that never arrived
    assert res["control"]["error"] and "rank(s) [1] stopped answering" in res["control"]["error"], res
    assert T * 0.9 <= res["control"]["s"] < T * 2.4, res
    # (c) a stopped peer is fenced: killed by rank 0 (SIGKILL), not left for a launcher
    assert res["fence"]["error"] and "killed it" in res["fence"]["error"], res
    assert peer_code == -9, peer_code


def test_timeout_values_are_checked():
    from titan_ext.runtime import timeouts

    for bad in (0, -1, float("nan"), float("inf"), "30", True):
        with pytest.raises(ValueError, match="timeout"):
            timeouts.set_timeout(bad)
