"""Delegate processes and their rings: create, start, watch, stop (PipeMorph §5.2; docs/delegate.md).

A :class:`Lane` is one delegate process of one link and one epoch, with its shared-memory slot ring;
:class:`LaneProcesses` owns every lane a pool started (respawned ones included).  It makes the
device choices of a lane through the runtime's device layer (``_device.py``): the ring's
``cudaHostRegister`` and the device flags run under the layer's context, so a lane created by the
supervisor thread (a respawn) lands on the stage's device, not on the thread's device 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch

from . import ring as R
from ._device import side_context
from .link import DelegateError


class Lane:
    """One delegate process and its ring (a link's delegate of one epoch)."""

    def __init__(self, channel, index: int, role: str, ring: R.SlotRing, epoch: int = 0):
        self.channel, self.index, self.role, self.ring, self.epoch = channel, index, role, ring, epoch
        self.proc: subprocess.Popen | None = None
        self.pidfd: int | None = None
        self.cursor = 0
        self.keep: list = [None] * ring.num_slots   # tensors an async copy still reads / writes
        self.tokens: list[int] = [0] * ring.num_slots
        self.dev_flags: torch.Tensor | None = None
        self._beat = (-1, 0.0)   # (last CTRL_HEARTBEAT seen, when it changed)

    def frozen(self, timeout_s: float) -> bool:
        """The delegate's heartbeat (worker.py) has not moved for ``timeout_s``: stopped (SIGSTOP) or
        hung — treated like a dead delegate.  Watched once it runs (its start, which imports
        torch, has its own timeout)."""
        beat, now = self.ring.region.load64(R.CTRL_HEARTBEAT), time.monotonic()
        if beat != self._beat[0] or self.ring.region.load(R.CTRL_DELEGATE_STATE) != 1:
            self._beat = (beat, now)
            return False
        return now - self._beat[1] > timeout_s

    def describe(self) -> str:
        c = self.channel
        pid = self.proc.pid if self.proc else None
        epoch = f", epoch {self.epoch}" if self.epoch else ""
        return f"{self.role}-{c.direction} delegate lane {self.index} of {c.src}->{c.dst} (pid {pid}{epoch})"


def lane_dead(lane: Lane) -> bool:
    return lane.proc is None or lane.proc.poll() is not None


def kill_lane(lane: Lane) -> None:
    """SIGKILL and reap a delegate (it may be dead already, or stopped); its ring is final afterwards."""
    proc = lane.proc
    if proc is not None and proc.poll() is None:
        try:
            proc.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    if lane.pidfd is not None:
        os.close(lane.pidfd)
        lane.pidfd = None


class LaneProcesses:
    """Every delegate process of one pool: ring geometry, rendezvous namespace, start, checks, stop."""

    def __init__(self, pool_id: str, num_slots: int, slot_bytes: int, store: tuple[str, int],
                 timeout_s: float, heartbeat_timeout_s: float, layer=None):
        self.pool_id, self.num_slots, self.slot_bytes = pool_id, num_slots, slot_bytes
        self.store_host, self.store_port = store
        self.timeout_s, self.heartbeat_timeout_s = timeout_s, heartbeat_timeout_s
        self.layer = layer                  # the CUDA device layer, None on CPU
        self.context = side_context(layer)  # captured on the training thread (the supervisor respawns)
        self.spawned: list[Lane] = []       # every delegate started (respawns included)
        self.closed = False

    def prefix(self, c, index: int, epoch: int) -> str:
        """Store namespace of one delegate pair (both ends build the same one)."""
        return f"titanx/{self.pool_id}/{c.src}-{c.dst}/{c.direction}/{index}/" + (f"e{epoch}/" if epoch else "")

    def new_lane(self, ch, index: int, role: str, epoch: int) -> Lane:
        """A lane and its ring; with CUDA its device flags on the stage's device (from any thread)."""
        lane = Lane(ch, index, role, R.SlotRing.create(self.num_slots, self.slot_bytes), epoch)
        if self.layer is not None:
            with self.context():
                lane.ring.region.cuda_register()
                lane.dev_flags = torch.zeros(self.num_slots, dtype=torch.int32, device=self.layer.device)
        return lane

    def launch(self, lane: Lane) -> None:
        self.spawned.append(lane)
        lane.proc = self._spawn(lane)
        lane.pidfd = os.pidfd_open(lane.proc.pid)

    def _spawn(self, lane: Lane) -> subprocess.Popen:
        fd = lane.ring.region.fd
        cmd = [sys.executable, "-m", "titan_ext.runtime.comm.delegate.worker", "--fd", str(fd),
               "--slots", str(lane.ring.num_slots), "--slot-bytes", str(lane.ring.slot_bytes),
               "--role", lane.role, "--store-host", self.store_host, "--store-port", str(self.store_port),
               "--prefix", self.prefix(lane.channel, lane.index, lane.epoch),
               "--parent", str(os.getpid()), "--timeout-s", str(max(self.timeout_s, 60.0))]
        if self.layer is not None:
            cmd.append("--gpu-flags")
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["CUDA_VISIBLE_DEVICES"] = ""  # delegates never touch the GPU
        return subprocess.Popen(cmd, pass_fds=(fd,), env=env, close_fds=True)

    def wait_started(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for lane in self.spawned:
            while lane.ring.region.load(R.CTRL_DELEGATE_STATE) != 1:
                self.check(lane)
                if time.monotonic() > deadline:
                    raise DelegateError(f"{lane.describe()} did not start within {timeout_s:.0f} s")
                time.sleep(0.01)

    def check(self, lane: Lane) -> None:
        """Raise :class:`DelegateError` if the lane's delegate failed, died or froze (no fallback)."""
        err = lane.ring.error_text()
        if err:
            raise DelegateError(f"{lane.describe()} failed: {err}")
        if lane.proc is not None and lane.proc.poll() is not None:
            rc = lane.proc.returncode
            how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
            raise DelegateError(f"{lane.describe()} {how}; fallback is off (enable_fallback) — stopping")
        if lane.frozen(self.heartbeat_timeout_s):
            raise DelegateError(f"{lane.describe()} is frozen (no heartbeat for {self.heartbeat_timeout_s:.0f} s);"
                                f" fallback is off (enable_fallback) — stopping")

    def pids(self) -> list[int]:
        return [lane.proc.pid for lane in self.spawned if lane.proc is not None]

    def stop(self, grace_s: float) -> None:
        """Send delegates first drain what is queued (up to ``grace_s``), then all are terminated."""
        lanes = list(self.spawned)
        for lane in lanes:
            lane.ring.region.store(R.CTRL_STOP, 1)
            for i in range(lane.ring.num_slots):  # wake delegates sleeping on a slot flag
                lane.ring.region.store(lane.ring.state_offset(i), lane.ring.state(i))
        deadline = time.monotonic() + grace_s
        for lane in lanes:
            if lane.proc is None or lane.role != "send":
                continue
            try:
                lane.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for lane in lanes:
            if lane.proc is not None and lane.proc.poll() is None:
                lane.proc.send_signal(signal.SIGTERM)
        for lane in lanes:
            if lane.proc is None:
                continue
            try:
                lane.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                lane.proc.kill()
                lane.proc.wait()
        for lane in lanes:
            kill_lane(lane)  # closes the pidfds
