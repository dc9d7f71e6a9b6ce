"""One ``isend``/``irecv`` API over three paths: direct P2P, delegates, and direct with failover.

:class:`P2PRouter` is what a schedule talks to.  It numbers the messages of every channel
``(peer, direction)`` (both ends count the same way, like direct P2P matches the n-th send with the
n-th receive) and routes each message:

* ``delegating`` (delegation mode on, or the channel failed over) → the :class:`DelegatePool`;
* otherwise → direct ``torch.distributed`` P2P on ``group``; with ``failover`` on, a direct operation
  that raises, fails on ``wait()`` or (receive) does not complete within ``recv_timeout_s`` is retried
  on the delegate path, by both ends, without losing or duplicating the message (PipeMorph §5.3):
  the sender re-sends it through its delegates; the receiver takes it from its delegates (as soon as it
  shows up there, or after the timeout); a copy that arrives twice is dropped by sequence number.
  A channel that failed over stays on the delegate path (its direct pair is no longer trusted).

Fault model and limits: a failed link is seen by the sender (error or timeout on the send, as with an
RNIC failure / NCCL timeout).  If the sender's direct send *succeeded* but the receiver still timed
out, the receiver waits ``pool.timeout_s`` on the delegate path and then raises :class:`DelegateError`
(a clear stop, never a silent hang or a wrong tensor).  A direct Gloo receive that is abandoned
(failover while it was posted) later hits the group's timeout, and Gloo then closes that pair of the
direct group: traffic of the channel keeps flowing through the delegates, but collectives on the same
group over that pair would fail — on a real dead link they fail anyway.

Delay injection for tests and benchmarks: ``hol_delay_ms[peer]`` holds the caller of a direct send for
that long before posting it — the head-of-line blocking of PipeMorph §3.2 (a send that cannot start
blocks the compute after it).  On the delegate path the same delay is applied inside the send delegate
(:meth:`DelegatePool.set_link_delay_ms`), off the training process's critical path.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Mapping, Protocol

import torch
import torch.distributed as dist

from titan_ext.args import (
    ArgumentTypeError,
    bool_arg,
    int_arg,
    mapping_arg,
    real_arg,
)

from .pool import DelegatePool

__all__ = ["DelegationMode", "Faults", "P2PRouter"]

MODES = ("off", "auto", "always")


def DelegationMode(mode: str) -> str:  # noqa: N802 - validated enum-like string
    if mode not in MODES:
        raise ValueError(f"delegation mode must be one of {MODES}, got {mode!r}")
    return mode


NCCL_FAILOVER_REFUSAL = (
    "P2PRouter(failover=True) retries each failed op and cannot work on an NCCL PP group: a hung NCCL send "
    "does not raise from wait() (the watchdog kills the process after the timeout), and the retry would issue "
    "ops on the pair from another thread and out of order. A schedule's failover (delegation_failover) on an "
    "NCCL PP group is step-level instead: StepFailover in runtime/comm/delegate/schedule.py (docs/delegate.md)")


def is_nccl(group=None) -> bool:
    """The P2P ops of ``group`` (None: the default group) run on NCCL."""
    if not dist.is_available() or not dist.is_initialized():
        return False
    return "nccl" in str(dist.get_backend(group)).lower()


class Faults(Protocol):
    """What ``faults=`` takes (tests): ``fails(op, peer, direction, seq) -> bool`` with op "send"/"recv";
    True fails that direct operation (a dead link: the send raises, the receive is never satisfied).
    The tests' implementation is ``FaultInjector`` (``testing/faults.py``)."""

    def fails(self, op: str, peer: int, direction: str, seq: int) -> bool: ...


class _Done:
    def wait(self, timeout=None) -> bool:  # noqa: ARG002
        return True

    def is_completed(self) -> bool:
        return True


class _FailoverSend:
    """A direct send whose failure on ``wait()`` re-sends the message through the delegates."""

    def __init__(self, router: "P2PRouter", work, tensor, peer, direction, seq):
        self.router, self.work, self.args = router, work, (tensor, peer, direction, seq)
        self.done = False

    def wait(self, timeout=None) -> bool:  # noqa: ARG002
        if self.done:
            return True
        tensor, peer, direction, seq = self.args
        try:
            self.work.wait()
        except Exception as exc:  # noqa: BLE001 - retried on the delegate path
            self.router._fail_over(peer, direction, f"send {seq}: {exc}")
            self.router.pool.send(tensor, peer, direction, seq)
        self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done or self.work.is_completed()


class _FailoverRecv:
    """A direct receive that falls back to the delegate path (message shows up there, error, timeout)."""

    def __init__(self, router: "P2PRouter", work, tensor, peer, direction, seq):
        self.router, self.work = router, work
        self.tensor, self.peer, self.direction, self.seq = tensor, peer, direction, seq
        self.done = False
        self.path = "direct"
        self._direct_done = threading.Event()
        self._direct_error: BaseException | None = None
        if work is not None:
            # Gloo's receive work only completes inside wait(): wait in a helper thread so this
            # handle can watch the delegate path at the same time.
            threading.Thread(target=self._wait_direct, daemon=True, name="titan_ext-failover-recv").start()

    def _wait_direct(self) -> None:
        try:
            self.work.wait(timedelta(seconds=self.router.recv_timeout_s))
        except BaseException as exc:  # noqa: BLE001 - surfaced by wait()
            self._direct_error = exc
        self._direct_done.set()

    def wait(self, timeout=None) -> bool:  # noqa: ARG002
        if self.done:
            return True
        r, pool = self.router, self.router.pool
        deadline = time.monotonic() + r.recv_timeout_s
        reason = None
        sleep = 20e-6
        while True:
            if self._direct_done.is_set():
                if self._direct_error is None:
                    pool.cancel(self.peer, self.direction, self.seq)  # a delegate copy would be a duplicate
                    self.done = True
                    return True
                reason = f"recv {self.seq}: {self._direct_error}"
                break
            if r._arrived(self.peer, self.direction, self.seq):
                reason = f"recv {self.seq}: the sender re-sent it on the delegate path"
                break
            if time.monotonic() > deadline:
                reason = f"recv {self.seq}: no data on the direct path within {r.recv_timeout_s:.1f} s"
                break
            time.sleep(sleep)
            sleep = min(sleep * 2, 1e-3)
        r._fail_over(self.peer, self.direction, reason)
        tmp = torch.empty_like(self.tensor)  # the abandoned direct receive may still write into its buffer
        pool.post_recv(tmp, self.peer, self.direction, self.seq).wait()
        with torch.no_grad():  # receive buffers of pipeline stages are leaves that require grad
            self.tensor.copy_(tmp)
        self.path = "delegate"
        self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


class P2PRouter:
    """Numbers and routes P2P messages (see the module docstring).

    Args:
        rank: this rank (global).
        pool: the delegate pool (needed when delegating or with failover; may be None otherwise).
        group: process group of the direct path (None: default group); peers are global ranks.
        delegating: start with delegation on.
        failover: retry failed direct operations on the delegate path.
        recv_timeout_s: a direct receive with no data for this long fails over.
        faults: primary-path faults for tests (:class:`Faults`).
        hol_delay_ms: ``{peer: ms}`` head-of-line delay of direct sends (tests/benchmarks).
        delegate_fallback: a killed delegate's lane falls back to direct P2P on ``group`` exactly, its
            delegate is respawned and the lane returns to it (:meth:`DelegatePool.enable_fallback`);
            False: a dead delegate stops training with :class:`DelegateError`.  Both ends must agree.
            Gloo groups only: on an NCCL ``group`` it is off (a clean stop), and ``failover=True`` (the
            per-op retry) is refused with a ValueError (NCCL ignores tags, runs a pair's ops in issue
            order from one thread and does not raise on a hung send); a schedule's failover on an NCCL
            PP group is step-level (:class:`~titan_ext.runtime.comm.delegate.schedule.StepFailover`), not this router's.
    """

    def __init__(self, rank: int, pool: DelegatePool | None = None, group=None, delegating: bool = False,
                 failover: bool = False, recv_timeout_s: float = 30.0, faults: Faults | None = None,
                 hol_delay_ms: Mapping[int, float] | None = None, delegate_fallback: bool = True):
        # every argument checked before the pool's fallback is switched on
        int_arg(rank, "rank", 0)
        if pool is not None and not hasattr(pool, "enable_fallback"):
            raise ArgumentTypeError(f"pool must be a DelegatePool or None, got {pool!r}")
        for name, value in (("delegating", delegating), ("failover", failover), ("delegate_fallback", delegate_fallback)):
            bool_arg(value, name)
        real_arg(recv_timeout_s, "recv_timeout_s", positive=True)
        if faults is not None and not callable(getattr(faults, "fails", None)):
            raise ArgumentTypeError(f"faults must be a FaultInjector (with fails(op, peer, direction, seq)) or None, "
                                    f"got {faults!r}")
        for peer, ms in mapping_arg(hol_delay_ms or {}, "hol_delay_ms", "peer -> ms").items():
            int_arg(peer, "hol_delay_ms peer", 0)
            real_arg(ms, f"hol_delay_ms[{peer!r}]", minimum=0)
        if (delegating or failover) and pool is None:
            raise ValueError("delegation and failover need a DelegatePool")
        nccl = is_nccl(group)
        if failover and nccl:
            raise ValueError(NCCL_FAILOVER_REFUSAL)
        # the killed-delegate fallback sends host route markers on ``group`` from the supervisor thread:
        # not on NCCL (docs/delegate.md) — there a dead or frozen delegate is a clean stop
        self.delegate_fallback = bool(pool is not None and delegate_fallback and not nccl)
        if self.delegate_fallback:
            pool.enable_fallback(group)
        self.rank, self.pool, self.group = rank, pool, group
        self.delegating = delegating
        self.delegate_peers: frozenset[int] | None = None  # while delegating, only these peers; None: all
        self.failover = failover
        self.recv_timeout_s = recv_timeout_s
        self.faults = faults
        self.hol_delay_ms = dict(hol_delay_ms or {})
        self.failed: dict[tuple[int, str], str] = {}   # channel -> reason it failed over
        self.failover_events: list[dict] = []
        self._send_seq: dict[tuple[int, str], int] = {}
        self._recv_seq: dict[tuple[int, str], int] = {}
        self.counts = {"direct": 0, "delegate": 0}
        self.delegate_bytes: dict[str, int] = {"F": 0, "B": 0}   # bytes handed to send delegates

    # --- numbering --------------------------------------------------------------------------------
    def _next(self, table, key) -> int:
        seq = table.get(key, 0)
        table[key] = seq + 1
        return seq

    def _use_delegates(self, key) -> bool:
        peers = self.delegate_peers
        return (self.delegating and (peers is None or key[0] in peers)) or key in self.failed

    def _fail_over(self, peer: int, direction: str, reason: str) -> None:
        key = (peer, direction)
        if key not in self.failed:
            self.failed[key] = reason
            self.failover_events.append({"peer": peer, "direction": direction, "reason": reason,
                                         "time": time.time()})

    def _arrived(self, peer, direction, seq) -> bool:
        """Did ``seq`` show up on the delegate path (receive not posted there yet)?"""
        return self.pool.arrived(peer, direction, seq)

    # --- API --------------------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, peer: int, direction: str, due_ns: int = 0):
        """``due_ns``: on the delegate path, sent no earlier than this ``time.monotonic_ns()`` (an
        injected link delay, :meth:`DelegatePool.send`)."""
        key = (peer, direction)
        seq = self._next(self._send_seq, key)
        if self._use_delegates(key):
            self.counts["delegate"] += 1
            self.delegate_bytes[direction] += tensor.numel() * tensor.element_size()
            return self.pool.send(tensor, peer, direction, seq, due_ns)
        self.counts["direct"] += 1
        delay = self.hol_delay_ms.get(peer, 0.0)
        if delay > 0:
            time.sleep(delay / 1e3)
        if not self.failover:
            return dist.isend(tensor, peer, group=self.group)
        try:
            if self.faults is not None and self.faults.fails("send", peer, direction, seq):
                raise RuntimeError(f"injected primary-path fault on send {seq} to rank {peer} ({direction})")
            work = dist.isend(tensor, peer, group=self.group)
        except Exception as exc:  # noqa: BLE001 - retried on the delegate path
            self._fail_over(peer, direction, f"send {seq}: {exc}")
            self.counts["delegate"] += 1
            return self.pool.send(tensor, peer, direction, seq)
        return _FailoverSend(self, work, tensor, peer, direction, seq)

    def irecv(self, tensor: torch.Tensor, peer: int, direction: str):
        key = (peer, direction)
        seq = self._next(self._recv_seq, key)
        if self._use_delegates(key):
            self.counts["delegate"] += 1
            return self.pool.post_recv(tensor, peer, direction, seq)
        self.counts["direct"] += 1
        if not self.failover:
            return dist.irecv(tensor, peer, group=self.group)
        if self.faults is not None and self.faults.fails("recv", peer, direction, seq):
            work = None  # a dead link: the direct receive never completes
        else:
            work = dist.irecv(tensor, peer, group=self.group)
        return _FailoverRecv(self, work, tensor, peer, direction, seq)

    def stats(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "failed_over": dict(self.failed),
                "delegates": self.pool.stats() if self.pool is not None else [],
                "delegate_fallbacks": list(self.pool.fallback_events) if self.pool is not None else []}
