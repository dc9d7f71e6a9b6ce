"""The control plane: a gloo process group over the PP ranks, created once with the schedule.

Everything the adaptive runtime agrees on goes here, never on the PP *data* group: the per-iteration
profile exchange, the plan-hash agreement, votes (e.g. delegation's "is a link slow?") and the
start-up clock-offset ping-pong.  The data group under TorchTitan is NCCL, whose collectives refuse
CPU tensors; the control messages are small CPU vectors, so a gloo group is their natural home and
keeps them off the device streams (PipeMorph §6: the profiler reports its profiles over Redis, off the GPU).

Creation uses ``use_local_synchronization=True``: only the PP group's ranks enter ``new_group``, so a
DP×PP job where every PP group builds its own schedule does not need all ranks of the world in step.
torch names such a group (and its store prefix) from its ranks *and the number of groups the calling
process already has* (``len(_world.pg_names)``), so PP ranks that hold different numbers of groups (a
DP group, a delegate or Falcon group on some ranks only) would wait on different store keys forever;
:func:`new_control_group` names it from the ranks and how many control groups this process made over
those ranks, which every PP rank agrees on.  torch 2.15 salts that name with ``_world.group_count``
instead, which a local-synchronization group advances on its members only, so every later
default-named group (``new_group()`` on all ranks) would get another name, and store prefix, on each
rank; the name given here leaves that count alone.  With one rank (or no process group) every exchange
is local.

Timeouts: the group is created with the schedule's ``timeout_s`` (else the current job
timeout of :mod:`.timeouts`) and follows :func:`.timeouts.set_timeout`; a collective that times out
names the ranks that never reached it.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from ..measure.profiler import estimate_clock_offsets
from . import timeouts

__all__ = ["ControlPlane"]


def pp_global_ranks(data_group: Any) -> list[int]:
    """Global ranks of the PP data group, in group-rank order (``None``: the default group)."""
    if data_group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(data_group))


_made: Counter = Counter()  # control groups made by this process, by rank set
_naming = threading.Lock()


def new_control_group(ranks: list[int], timeout_s: float | None = None) -> Any:
    """A gloo group over ``ranks`` entered by those ranks only, named the same on each of them, with
    ``timeout_s`` (None: the job's current timeout, :mod:`.timeouts`)."""
    from torch.distributed import distributed_c10d as c10d

    key = tuple(ranks)
    with _naming:
        name = hashlib.sha1(f"titan_ext_control_{'_'.join(map(str, key))}_{_made[key]}".encode(),
                            usedforsecurity=False).hexdigest()
        _made[key] += 1
        torch_name = c10d._process_group_name
        c10d._process_group_name = lambda ranks, use_hashed_name: name  # noqa: ARG005
        try:
            return timeouts.new_group(list(ranks), timeout_s, backend="gloo", use_local_synchronization=True)
        finally:
            c10d._process_group_name = torch_name


class ControlPlane:
    """CPU collectives of one PP group on its own gloo group (one per schedule)."""

    def __init__(self, data_group: Any = None, group: Any = None, timeout_s: float | None = None):
        """``group``: an existing gloo group over the same ranks to reuse (else one is created, with
        ``timeout_s``: None → the job's current timeout, :mod:`.timeouts`)."""
        self.distributed = dist.is_available() and dist.is_initialized()
        self.ranks = pp_global_ranks(data_group) if self.distributed else [0]
        self.size = len(self.ranks)
        self.group = None
        if self.distributed and self.size > 1:
            self.group = group if group is not None else new_control_group(self.ranks, timeout_s)
        self._met = False
        self._inflight: Gathering | None = None  # a started all_gather not waited for yet (start_all_gather)
        self._expected: dict[int, tuple[torch.Tensor, list[Any]]] = {}  # tag → receives posted early (expect)
        #: (clock_self − clock_prev [s], min RTT [s]), measured once at the first training step (:meth:`sync_clock`)
        self.clock: tuple[float, float] = (math.nan, math.nan)
        self._clock_synced = False

    @property
    def local(self) -> bool:
        return self.group is None

    def all_gather(self, vector: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's copy of a CPU vector of identical shape and dtype, by PP rank.  A device vector is
        refused: copying it to the host here would be a blocking device-to-host copy (a host sync) on the
        caller's thread."""
        return self.start_all_gather(vector).result()

    def expect(self, numel: int, tag: int, dtype: torch.dtype = torch.float64) -> None:
        """Post the receives of the next :meth:`start_all_gather` on ``tag`` now, for vectors of ``numel``
        values of ``dtype`` (nothing if they are posted already).  gloo's TCP pairs hand a message over only
        once its receive is posted (a send waits for the peer's "ready to receive"): a receive posted at the
        gather takes a round trip through every peer's transport thread, the rank that arrives last
        included; posted earlier (at the start of the iteration whose boundary exchanges), every peer's
        message lands as it is sent and the last rank's gather finds them there.  Every rank posts the
        same receives in the same order (the gathers' order), so messages match FIFO per peer and tag."""
        if self.local or tag in self._expected:
            return
        received = torch.empty((self.size, numel), dtype=dtype)
        me = self.ranks.index(dist.get_rank())
        self._expected[tag] = (received, dist.batch_isend_irecv([  # posting waits for nothing
            dist.P2POp(dist.irecv, received[i], peer, group=self.group, tag=tag)
            for i, peer in enumerate(self.ranks) if i != me]))

    def start_all_gather(self, vector: torch.Tensor, tag: int = 0, ring: bool = False) -> "Gathering":
        """:meth:`all_gather` posted, not waited for: the messages travel while the caller goes on (the
        next iteration runs); :meth:`Gathering.result` waits for them.  Every rank must start the same
        gathers in the same order; every later collective of this plane first waits for one in flight.
        ``tag``: the messages' point-to-point tag (receives posted by :meth:`expect` on it are used).
        ``ring`` (and no receives posted on ``tag``): gloo's own ``all_gather`` instead, for an exchange read
        at the next boundary (a check that runs behind): one call on the caller's thread, the ring's S − 1
        hops on gloo's worker thread, where the point-to-point exchange posts S − 1 sends from the caller
        (0.64 → 0.37 ms of a check's CPU at 16 ranks); its hops in sequence are slower to arrive than one
        hop (:meth:`_send`), which the next iteration hides."""
        if vector.device.type != "cpu":
            raise ValueError(f"the control plane carries host tensors, got one on {vector.device}: make it "
                             f"on the host (the device's values are read by the device layer)")
        vector = vector.detach()
        if self.local:
            return Gathering([vector], [], None)
        if ring and tag not in self._expected:
            out = [torch.empty_like(vector) for _ in self.ranks]
            works = self._collective("all_gather", lambda: [
                dist.all_gather(out, vector, group=self.group, async_op=True)])
            self._inflight = Gathering(out, works, lambda run: self._named("all_gather/wait", run))
            return self._inflight
        self.expect(vector.numel(), tag, vector.dtype)  # now, unless posted early
        received, works = self._expected.pop(tag)
        if received.shape[1] != vector.numel() or received.dtype != vector.dtype:
            raise ValueError(f"gather on tag {tag}: receives were posted for {received.shape[1]} x "
                             f"{received.dtype}, the vector is {vector.numel()} x {vector.dtype}")
        out = [row.view_as(vector) for row in received]
        works = works + self._collective("all_gather", lambda: self._send(out, vector, tag))
        self._inflight = Gathering(out, works, lambda run: self._named("all_gather/wait", run))
        return self._inflight

    def settle(self) -> None:
        """Wait for the gather in flight, if any (its result stays with its :class:`Gathering`)."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.wait()

    def _send(self, out: list[torch.Tensor], vector: torch.Tensor, tag: int) -> list[Any]:
        """All-gather as one message to and from every other rank, all in flight at once (the receives:
        :meth:`expect`): the rank that arrives last waits one hop, where gloo's ring ``all_gather`` passes
        S − 1 hops in sequence (on a busy 2-core host each hop is a process wake-up: 4 ranks 4.1 → 2.7 ms
        median, 8 ranks 12.1 → 8.8 ms). Point-to-point on the control group: at most one gather is in flight
        per tag (every other collective settles it first) and each rank posts its sends and receives in rank
        order, so messages match in FIFO order per peer; gloo keeps p2p tags apart from its collectives' slots."""
        out[self.ranks.index(dist.get_rank())].copy_(vector)
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, vector, peer, group=self.group, tag=tag)
                                       for peer in self.ranks if peer != dist.get_rank()])

    def gather_ints(self, value: int) -> list[int]:
        """Every rank's integer (e.g. a 52-bit plan hash), by PP rank."""
        return [int(t.item()) for t in self.all_gather(torch.tensor([int(value)], dtype=torch.int64))]

    def agree(self, value: int) -> tuple[bool, list[int]]:
        """(all ranks hold the same value, the distinct values seen)."""
        seen = sorted(set(self.gather_ints(value)))
        return len(seen) == 1, seen

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on any rank (one MAX all-reduce)."""
        vote = torch.tensor([1.0 if flag else 0.0])
        if not self.local:
            self._collective("vote", lambda: dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self.group))
        return bool(vote.item() > 0)

    def meet(self, name: str) -> None:
        """Every PP rank reaches this point (one tiny all-reduce), or :class:`~.timeouts.PeerTimeout`
        after the group's timeout naming the ranks that did not (and fencing a stopped one on this host)."""
        if not self.local:
            token = torch.zeros(1)
            self._collective(name, lambda: dist.all_reduce(token, group=self.group))

    def meet_once(self, name: str) -> None:
        """:meth:`meet`, the first time only (the first step: torch's start-up messages would otherwise
        wait with the PP group's creation timeout and name nobody)."""
        if not self._met:
            self.meet(name)
            self._met = True

    def sync_clock(self) -> None:
        """Measure :attr:`clock` once (every PP rank calls it at the same step)."""
        if not self._clock_synced:
            self.clock = self.clock_offsets()
            self._clock_synced = True

    def clock_offsets(self) -> tuple[float, float]:
        """(clock_self − clock_prev [s], min RTT [s]) by NTP-style ping-pong (profiler's method)."""
        if self.local:
            return math.nan, math.nan
        return self._collective("clock_offsets", lambda: estimate_clock_offsets(self.group))

    def _collective(self, name: str, run):
        """Every collective of this plane starts here: after the gather in flight, if any (:meth:`settle`)."""
        self.settle()
        return self._named(name, run)

    def _named(self, name: str, run):
        return timeouts.named_collective(self.group, self.ranks, f"control/{min(self.ranks)}/{name}", run)


class Gathering:
    """An all_gather in flight (:meth:`ControlPlane.start_all_gather`): :meth:`result` waits once (under
    the plane's timeout, naming a rank that never sent) and returns every rank's vector, by PP rank."""

    def __init__(self, out: list[torch.Tensor], works: list[Any], guard: Any):
        self._out, self._works, self._guard = out, works, guard

    def wait(self) -> None:
        works, self._works = self._works, []
        if works:
            self._guard(lambda: [w.wait() for w in works])

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._out
