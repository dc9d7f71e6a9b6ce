"""Killed-delegate agreement when two links die at once (docs/delegate.md "Killed delegate").

Killing one rank's send-F and recv-B delegates takes down both links of the rank pair, and a supervisor
that was descheduled sees both deaths in one wake-up.  Each rank then has a send link that needs the
peer's replay point ``first`` and a receive link that publishes its own.  Two real :class:`Supervisor`
objects (one per rank, in threads, on one real TCPStore) run that tick; only the recovery's ring work
is replaced by a record of the calls.  A supervisor that waited for ``first`` on its send link before
publishing its receive link's would wait for the other one, both until ``timeout_s``."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from titan_ext.runtime.comm.delegate.pool import Channel
from titan_ext.runtime.comm.delegate.link import DOWN, UP, Link
from titan_ext.runtime.comm.delegate.recovery import Supervisor

from titan_ext.testing import free_port

FIRST = {"F": 12, "B": 9}   # what each receiver's dead ring delivered up to


class _DeadProc:
    pid, returncode = 0, -9

    def poll(self):
        return self.returncode


class _DeadLane:
    def __init__(self, channel, role):
        self.channel, self.role, self.index, self.epoch = channel, role, 0, 0
        self.proc, self.pidfd = _DeadProc(), None

    def describe(self):
        return f"{self.role}-{self.channel.direction}"


class _Pool:
    """The part of Recovery the supervisor calls; ring recovery and respawn are recorded."""

    def __init__(self, rank):
        self.rank, self.pool_id, self.timeout_s, self.closed = rank, "agree", 5.0, False
        self.heartbeat_timeout_s = 10.0
        peer = 1 - rank
        send = Channel(rank, peer, "F" if rank == 0 else "B")
        recv = Channel(peer, rank, "B" if rank == 0 else "F")
        self._links = [Link(send, 0, "send", 1, _DeadLane(send, "send")),   # the order links() gives
                       Link(recv, 0, "recv", 1, _DeadLane(recv, "recv"))]
        self.calls, self.fallback_events = [], []

    def links(self):
        return self._links

    def lane_prefix(self, c, index, epoch):
        return f"titanx/{self.pool_id}/{c.src}-{c.dst}/{c.direction}/{index}/" + (f"e{epoch}/" if epoch else "")

    def recover_recv(self, link):
        link.state = DOWN
        return FIRST[link.channel.direction]

    def recover_send(self, link, first):
        link.state = DOWN
        self.calls.append(("replay", link.channel.direction, first))
        return 0

    def respawn(self, link):
        self.calls.append(("respawn", link.role, link.channel.direction))

    def log_event(self, link, event, **info):
        self.fallback_events.append({"event": event, "kind": f"{link.role}-{link.channel.direction}", **info})


def test_two_links_dying_together_agree_without_waiting_for_each_other():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False)
    pools = [_Pool(0), _Pool(1)]
    sups = [Supervisor(p, "127.0.0.1", port) for p in pools]
    assert all(lk.state == UP for p in pools for lk in p.links())

    def run(sup):
        deadline = time.monotonic() + 3 * sup.recovery.timeout_s
        while any(lk.state != DOWN for lk in sup.recovery.links()) and time.monotonic() < deadline:
            sup._tick()

    threads = [threading.Thread(target=run, args=(s,)) for s in sups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in pools:
        assert [lk.error for lk in p.links()] == [None, None]
        fb = {e["kind"]: e["first_undelivered"] for e in p.fallback_events if e["event"] == "fallback"}
        send_dir = p.links()[0].channel.direction
        recv_dir = p.links()[1].channel.direction
        # each sender replays from exactly the point its peer's receiver published
        assert fb == {f"send-{send_dir}": FIRST[send_dir], f"recv-{recv_dir}": FIRST[recv_dir]}
        assert ("replay", send_dir, FIRST[send_dir]) in p.calls
        assert {c for c in p.calls if c[0] == "respawn"} == {("respawn", "send", send_dir),
                                                              ("respawn", "recv", recv_dir)}
    del master


def test_the_pool_parts_import_each_other_without_a_cycle():
    """The pool's parts (lanes, send path, receive matching, recovery) share only
    link.py/lanes.py; none imports pool.py, and the package's import graph has no cycle."""
    import ast
    import os

    import titan_ext.runtime.comm.delegate as pkg

    root = os.path.dirname(pkg.__file__)
    graph = {}
    for fn in os.listdir(root):
        if fn.endswith(".py"):
            deps = set()
            for node in ast.walk(ast.parse(open(os.path.join(root, fn)).read())):
                if isinstance(node, ast.ImportFrom) and node.level == 1:
                    deps |= {node.module} if node.module else {a.name for a in node.names}
            graph[fn[:-3]] = deps
    for part in ("lanes", "link", "recovery", "recvpath", "sendpath"):
        assert "pool" not in graph[part], (part, graph[part])

    def visit(m, path):
        assert m not in path, f"import cycle: {' -> '.join(path + [m])}"
        for d in graph.get(m, ()):
            visit(d, path + [m])

    for m in graph:
        visit(m, [])
