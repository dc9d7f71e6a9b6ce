"""Delegation mode in the PipeMorph schedule (PipeMorph §5.2 "Design", §5.3, §6 step ⑥).

``DelegatedPipeMorph`` is PipeMorph with its documented transport hook ``_issue_p2p(action, ops)``
routed through a :class:`~titan_ext.runtime.delegate.transport.P2PRouter`:

* ``delegation="off"``    — direct P2P (with ``failover=True``: retried on the delegates on error).
* ``delegation="always"`` — every SEND/RECV of the plan goes through the delegate processes.
* ``delegation="auto"``   — direct until the detector flags a slow link, then delegates, switched at an
  iteration boundary.  The default detector flags a link whose estimated delay (PipeMorph's own
  per-link estimate ``last_metrics["link_delay_ms"]``) exceeds ``slow_link_ms``; pass
  ``detector=callable(metrics) -> bool`` to use another one.  The ranks' verdicts are combined with one
  MAX vote on the control plane (``runtime/control.py``) at the boundary (only while not yet
  delegating), so all switch at the same boundary.

While delegating, activations queue in host memory (the delegates' slot rings), so the adaptive
planner's cap on warm-up forwards (``adaptive_memory_limit``) is lifted — adapted plans may exceed the
device memory budget (§5.2 "virtually no memory constraint in Algorithm 2").  It is restored if
delegation is switched off again (:meth:`set_delegation`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from titan_ext.runtime.pipemorph import PipeMorph

from .pool import DelegatePool, delegates_needed, pipeline_channels
from .transport import MODES, FaultInjector, P2PRouter

__all__ = ["DelegatedPipeMorph"]

_FWD = (_ComputationType.SEND_F, _ComputationType.RECV_F)


class DelegatedPipeMorph(PipeMorph):
    """PipeMorph whose PP sends/receives can go through delegate processes.

    Extra keyword arguments (the rest are PipeMorph's):
        delegation: "off" | "auto" | "always".
        failover: retry a failed/timed-out direct P2P on the delegate path (PipeMorph §5.3).
        slow_link_ms: auto mode's threshold on the estimated link delay.
        detector: auto mode's slow-link detector ``(last_metrics) -> bool`` (overrides slow_link_ms).
        delegate_lanes: delegates per kind (int or {"F": n, "B": m}), fixed for the pool's life; every
            boundary reports the §5.2 count for the measured rates in ``last_metrics["delegate_lanes_needed"]``.
        delegate_slots / delegate_slot_bytes: ring geometry per delegate.
        recv_timeout_s: failover's timeout of a direct receive.
        delegate_timeout_s: how long a delegate-path operation may wait before DelegateError.
        faults: a FaultInjector (tests).
    """

    def __init__(self, *args: Any, delegation: str = "off", failover: bool = False, slow_link_ms: float = 5.0,
                 detector: Callable[[dict], bool] | None = None, delegate_lanes: int | dict = 1,
                 delegate_slots: int = 16, delegate_slot_bytes: int = 16 << 20, recv_timeout_s: float = 30.0,
                 delegate_timeout_s: float = 300.0, faults: FaultInjector | None = None, **kwargs: Any):
        if delegation not in MODES:
            raise ValueError(f"delegation must be one of {MODES}, got {delegation!r}")
        super().__init__(*args, **kwargs)
        self.delegation = delegation
        if self.falcon is not None:  # Falcon's re-plan strategy may now come with delegation (§5)
            self.falcon.config.delegation_available = delegation != "off"
        self.slow_link_ms = slow_link_ms
        self.detector = detector
        self.delegation_log: list[dict] = []
        self._memory_limit_direct = self.adaptive_memory_limit
        self.pool: DelegatePool | None = None
        self.router: P2PRouter | None = None
        if delegation == "off" and not failover:
            return
        group = self._group
        rank = dist.get_rank()
        stage_to_rank = [self.stage_index_to_group_rank[s] for s in range(self._num_stages)]
        if group is not None:
            stage_to_rank = [dist.get_global_rank(group, r) for r in stage_to_rank]
        self.pool = DelegatePool(rank, pipeline_channels(rank, stage_to_rank), lanes=delegate_lanes,
                                 num_slots=delegate_slots, slot_bytes=delegate_slot_bytes,
                                 timeout_s=delegate_timeout_s)
        self.router = P2PRouter(rank, self.pool, group=group, failover=failover,
                                recv_timeout_s=recv_timeout_s, faults=faults)
        if delegation == "always":
            self.set_delegation(True, "delegation=always")

    # --- the transport hook ---------------------------------------------------------------------
    def _issue_p2p(self, action: _Action, ops: list[dist.P2POp]) -> list[Any]:
        router = self.router
        if router is None or not (router.delegating or router.failover):
            return super()._issue_p2p(action, ops)
        direction = "F" if action.computation_type in _FWD else "B"
        handles = []
        for op in ops:
            if op.op is dist.isend or getattr(op.op, "__name__", "") == "isend":
                handles.append(router.isend(op.tensor, op.peer, direction))
            else:
                handles.append(router.irecv(op.tensor, op.peer, direction))
        return handles

    # --- mode switching (iteration boundaries only) --------------------------------------------
    @property
    def delegating(self) -> bool:
        return bool(self.router and self.router.delegating)

    def set_delegation(self, on: bool, reason: str = "external") -> None:
        """Switch delegation on/off.  Only between iterations; call it on every rank alike."""
        if self._in_iteration:
            raise RuntimeError("delegation can only be switched at an iteration boundary")
        if self.router is None:
            raise RuntimeError("delegation='off' without failover has no delegates; construct with "
                               "delegation='auto' or 'always'")
        if on == self.router.delegating:
            return
        self.router.delegating = on
        self.adaptive_memory_limit = None if on else self._memory_limit_direct
        self.delegation_log.append({"iteration": self.iteration, "delegating": on, "reason": reason})
        self._log(decision="delegation", reason=f"{'on' if on else 'off'}: {reason}")

    def _slow_link(self) -> tuple[bool, str]:
        m = self.last_metrics
        if self.detector is not None:
            return bool(self.detector(m)), "detector"
        slow = {k: v for k, v in (m.get("link_delay_ms") or {}).items() if v == v and v > self.slow_link_ms}
        return bool(slow), f"slow links {slow} (> {self.slow_link_ms} ms)"

    def _iteration_boundary(self, prof, iteration_ms: float) -> None:
        super()._iteration_boundary(prof, iteration_ms)
        if self.delegation == "auto" and not self.delegating and self.router is not None:
            flagged, why = self._slow_link()
            # Ranks may see slightly different estimates (clock offsets): agree with one MAX vote on
            # the control plane, so every rank switches at the same boundary.
            if self.control.any(flagged):
                self.set_delegation(True, f"auto: {why if flagged else 'flagged by another rank'}")
        if self.router is not None:
            self.last_metrics["delegating"] = self.router.delegating
            self.last_metrics["failed_over_links"] = sorted(self.router.failed)
            self.last_metrics["delegate_lanes_needed"] = self._lanes_needed(iteration_ms)

    def _lanes_needed(self, iteration_ms: float) -> dict[str, int]:
        """§5.2 sizing from this iteration: production rate of each send kind (bytes handed to its
        delegates / iteration time) over the measured per-delegate throughput of that kind."""
        sent = dict(self.router.delegate_bytes)
        prev, self._bytes_prev = getattr(self, "_bytes_prev", {"F": 0, "B": 0}), sent
        out = {}
        if not self.router.delegating or not iteration_ms > 0:
            return out
        stats = self.pool.stats()
        for d in ("F", "B"):
            rates = [s["bytes_per_s"] for s in stats if s["kind"] == f"send-{d}" and s["bytes_per_s"] == s["bytes_per_s"]]
            produced = (sent[d] - prev.get(d, 0)) / (iteration_ms / 1e3)
            if rates and produced > 0:
                out[f"send-{d}"] = delegates_needed(produced, sum(rates) / len(rates))
        return out

    def close_delegation(self) -> None:
        """Stop the delegate processes (also done at interpreter exit)."""
        if self.pool is not None:
            self.pool.close()
