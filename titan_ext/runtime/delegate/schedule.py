"""Delegation as a transport choice of the adaptive schedules (PipeMorph §5.2 "Design", §5.3, §6 ⑥).

Any adaptive schedule (``PipeMorph``, ``CrossPipe``, any planner) built with ``delegation`` other than
"off" (or ``failover=True``) runs its SEND/RECV ops through a :class:`DelegateTransport` — the
:class:`~titan_ext.runtime.delegate.transport.P2PRouter` over a :class:`DelegatePool` — and gets a
:class:`Delegation` boundary observer:

* ``delegation="off"``    — direct P2P (with ``failover=True``: retried on the delegates on error).
* ``delegation="always"`` — every SEND/RECV of the plan goes through the delegate processes.
* ``delegation="auto"``   — direct until the detector flags a slow link, then delegates, switched at an
  iteration boundary.  The default detector flags a link whose estimated delay (the schedule's own
  per-link estimate ``last_metrics["link_delay_ms"]``) exceeds ``slow_link_ms``; pass
  ``detector=callable(metrics) -> bool`` to use another one.  The ranks' verdicts are combined with one
  MAX vote on the control plane (``runtime/control.py``) at the boundary (only while not yet
  delegating), so all switch at the same boundary.

While delegating, the configured ``adaptive_memory_limit`` is lifted (§5.2 "virtually no memory
constraint in Algorithm 2"); the measured device-memory cap (``runtime/memory.py``) still applies,
since the delegates carry the PP messages, not the activations autograd saves.

``DelegatedPipeMorph`` (PipeMorph with the delegation API on the schedule object: ``router``, ``pool``,
``set_delegation`` …) lives in :mod:`titan_ext.runtime.delegated`, above this package.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from titan_ext.runtime.observers import Boundary
from titan_ext.runtime.transport import TorchP2P

from .pool import DelegatePool, delegates_needed, pipeline_channels
from .transport import FaultInjector, P2PRouter

__all__ = ["Delegation", "DelegateTransport"]

_FWD = (_ComputationType.SEND_F, _ComputationType.RECV_F)


class DelegateTransport:
    """Transport through the router: direct torch P2P unless delegating or failing over."""

    def __init__(self, router: P2PRouter, pool: DelegatePool):
        self.router, self.pool = router, pool
        self._direct = TorchP2P()

    def issue(self, action: _Action, ops: list[dist.P2POp]) -> list[Any]:
        router = self.router
        if not (router.delegating or router.failover):
            return self._direct.issue(action, ops)
        direction = "F" if action.computation_type in _FWD else "B"
        handles = []
        for op in ops:
            if op.op is dist.isend or getattr(op.op, "__name__", "") == "isend":
                handles.append(router.isend(op.tensor, op.peer, direction))
            else:
                handles.append(router.irecv(op.tensor, op.peer, direction))
        return handles

    def close(self) -> None:
        self.pool.close()


class Delegation:
    """The delegate pool, its router and transport, and the boundary-time switching of one schedule."""

    def __init__(self, schedule: Any, mode: str, *, failover: bool = False, slow_link_ms: float = 5.0,
                 detector: Callable[[dict], bool] | None = None, lanes: int | dict = 1, slots: int = 16,
                 slot_bytes: int = 16 << 20, recv_timeout_s: float = 30.0, delegate_timeout_s: float = 300.0,
                 faults: FaultInjector | None = None):
        self.schedule, self.mode = schedule, mode
        self.slow_link_ms, self.detector = slow_link_ms, detector
        self.log: list[dict] = []
        group = schedule._group
        rank = dist.get_rank()
        stage_to_rank = [schedule.stage_index_to_group_rank[s] for s in range(schedule._num_stages)]
        if group is not None:
            stage_to_rank = [dist.get_global_rank(group, r) for r in stage_to_rank]
        self.pool = DelegatePool(rank, pipeline_channels(rank, stage_to_rank), lanes=lanes, num_slots=slots,
                                 slot_bytes=slot_bytes, timeout_s=delegate_timeout_s)
        self.router = P2PRouter(rank, self.pool, group=group, failover=failover, recv_timeout_s=recv_timeout_s,
                                faults=faults)
        self.transport = DelegateTransport(self.router, self.pool)
        self._bytes_prev = {"F": 0, "B": 0}

    @property
    def delegating(self) -> bool:
        return self.router.delegating

    def start(self) -> None:
        """After the schedule's initial plan: ``always`` delegates from the first iteration."""
        if self.mode == "always":
            self.set(True, "delegation=always")

    def set(self, on: bool, reason: str = "external", completed: int | None = None) -> None:
        """Switch delegation on/off.  Only between iterations; call it on every rank alike.
        ``completed``: iterations completed before the switch (default: the schedule's count)."""
        if self.schedule._in_iteration:
            raise RuntimeError("delegation can only be switched at an iteration boundary")
        if on == self.router.delegating:
            return
        self.router.delegating = on
        done = self.schedule.iteration if completed is None else completed
        self.log.append({"iteration": done, "delegating": on, "reason": reason})
        self.schedule._log(decision="delegation", reason=f"{'on' if on else 'off'}: {reason}")

    def _slow_link(self, metrics: dict) -> tuple[bool, str]:
        if self.detector is not None:
            return bool(self.detector(metrics)), "detector"
        slow = {k: v for k, v in (metrics.get("link_delay_ms") or {}).items() if v == v and v > self.slow_link_ms}
        return bool(slow), f"slow links {slow} (> {self.slow_link_ms} ms)"

    def observe(self, boundary: Boundary) -> dict[str, Any]:
        if self.mode == "auto" and not self.delegating and boundary.exchanged:
            flagged, why = self._slow_link(boundary.metrics)
            if self.schedule.control.any(flagged):
                self.set(True, f"auto: {why if flagged else 'flagged by another rank'}",
                         completed=boundary.iteration + 1)
        return {"delegating": self.router.delegating, "failed_over_links": sorted(self.router.failed),
                "delegate_lanes_needed": self._lanes_needed(boundary.iteration_ms)}

    def _lanes_needed(self, iteration_ms: float) -> dict[str, int]:
        """§5.2 sizing from this iteration: production rate of each send kind (bytes handed to its
        delegates / iteration time) over the measured per-delegate throughput of that kind."""
        sent = dict(self.router.delegate_bytes)
        prev, self._bytes_prev = self._bytes_prev, sent
        out: dict[str, int] = {}
        if not self.router.delegating or not iteration_ms > 0:
            return out
        stats = self.pool.stats()
        for d in ("F", "B"):
            rates = [s["bytes_per_s"] for s in stats if s["kind"] == f"send-{d}" and s["bytes_per_s"] == s["bytes_per_s"]]
            produced = (sent[d] - prev.get(d, 0)) / (iteration_ms / 1e3)
            if rates and produced > 0:
                out[f"send-{d}"] = delegates_needed(produced, sum(rates) / len(rates))
        return out

    def close(self) -> None:
        """Stop the delegate processes (also done at interpreter exit)."""
        self.pool.close()
