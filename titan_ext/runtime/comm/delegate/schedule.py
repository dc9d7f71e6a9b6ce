"""Delegation as a transport choice of the adaptive schedules (PipeMorph §5.2 "Design", §5.3, §6 ⑥).

Any adaptive schedule (``PipeMorph``, ``CrossPipe``, any planner) built with ``delegation`` other than
"off" (or ``failover=True``) runs its SEND/RECV ops through a :class:`DelegateTransport` — the
:class:`~titan_ext.runtime.comm.delegate.transport.P2PRouter` over a :class:`DelegatePool` — and gets a
:class:`Delegation` boundary observer:

* ``delegation="off"``    — direct P2P (with ``failover=True``: retried on the delegates on error — per
  op on a gloo PP group, per step on an NCCL one: the failure agreed on the control plane at the end of
  the step, every link moved to the delegates and the step re-run from its start, ``StepFailover``).
* ``delegation="always"`` — every SEND/RECV of the plan goes through the delegate processes.
* ``delegation="auto"``   — direct until the detector flags a slow link, then delegates, switched at an
  iteration boundary.  The default detector flags a link whose estimated delay (the schedule's own
  per-link estimate ``last_metrics["link_delay_ms"]``) exceeds ``slow_link_ms``; pass
  ``detector=callable(metrics) -> bool`` to use another one.  The ranks' verdicts are combined with one
  MAX vote on the control plane (``runtime/comm/control_plane.py``) at the boundary (only while not yet
  delegating), so all switch at the same boundary.

While delegating, the configured ``adaptive_memory_limit`` is lifted (§5.2 "virtually no memory
constraint in Algorithm 2"); the measured device-memory cap (``runtime/execute/memory.py``) still applies,
since the delegates carry the PP messages, not the activations autograd saves.

The API is the schedule's ``delegation`` property, the same for every adaptive schedule (there is no
delegating subclass): ``schedule.delegation.router`` (its ``counts``, ``failed``), ``.pool``, ``.log``,
``.delegating``, ``.set(on, reason)`` (between iterations, on every rank alike) and ``.close()``; None
with ``delegation="off"`` and no failover.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from titan_ext.args import instance_arg, int_arg
from ...control.config import DelegationConfig
from ...control.observers import Boundary, ScheduleContext
from ...emulate.delay_injection import current_injector
from .. import timeouts
from ..transport import TorchP2P

from .link import DelegateError
from .pool import DelegatePool, delegates_needed, pipeline_channels, pool_shm_bytes
from .ring import PAGE, SharedMemoryShortage, check_shm
from .transport import P2PRouter, is_nccl

__all__ = ["Delegation", "DelegateTransport", "StepFailover", "abort_group", "is_link_failure", "message_slot_bytes"]

_FWD = (_ComputationType.SEND_F, _ComputationType.RECV_F)
log = logging.getLogger(__name__)


class DelegateTransport:
    """Transport through the router: direct torch P2P unless delegating or failing over."""

    def __init__(self, delegation: "Delegation"):
        self.delegation = delegation
        self._direct = TorchP2P()

    def issue(self, action: _Action, ops: list[dist.P2POp]) -> list[Any]:
        d = self.delegation
        if not (d.delegating or d.failover):
            return self._direct.issue(action, ops)
        router = d.ensure_started(ops)
        per_op = d.failover and d.step_failover is None
        if router is None or not (per_op or all(d.delegates(op.peer) for op in ops)):
            # no shared memory for the delegates on some rank (every rank went direct), a link that is
            # not delegated, or an NCCL PP group before its step-level failover (torch's batched P2P)
            return self._direct.issue(action, ops)
        direction = "F" if action.computation_type in _FWD else "B"
        injector = current_injector()  # an injected link delay holds on every path (delay_injection.py)
        handles = []
        for op in ops:
            if op.op is dist.isend or getattr(op.op, "__name__", "") == "isend":
                due = injector.delegated_due_ns(op) if injector is not None and d.delegates(op.peer) else 0
                handles.append(router.isend(op.tensor, op.peer, direction, due))
            else:
                handles.append(router.irecv(op.tensor, op.peer, direction))
        return handles

    def close(self) -> None:
        self.delegation.close()


def _links_arg(links: Any) -> frozenset[frozenset[int]]:
    """``Delegation.set``'s ``links``: pairs of distinct global ranks (a clear error otherwise)."""
    out = set()
    for link in links if isinstance(links, (list, tuple, set, frozenset)) else [links]:
        if (not isinstance(link, (list, tuple)) or len(link) != 2 or link[0] == link[1]
                or any(isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 0 for r in link)):
            raise ValueError(f"links must be pairs of two different global ranks, e.g. [(0, 1)]; got {link!r}")
        out.add(frozenset(int(r) for r in link))
    return frozenset(out)


def message_slot_bytes(nbytes: int) -> int:
    """Slot size for messages of at most ``nbytes`` payload bytes: rounded up to a 4 KiB page (a slot's
    payload follows a page-aligned header, ring.py)."""
    int_arg(nbytes, "nbytes", 0)
    return max(PAGE, (nbytes + PAGE - 1) // PAGE * PAGE)


class Delegation:
    """The delegate pool, its router and transport, and the boundary-time switching of one schedule.

    The pool is started at the first SEND/RECV that uses it (the first op of the first delegated or
    failover iteration, on every rank in the same iteration).  ``slot_bytes=None`` (the default) sizes
    its slots from the stage's messages: each rank contributes the size of that first op's tensors —
    stage 0's first forward output, and every later stage's first forward input (= the previous stage's
    output) — and the largest over the ranks (one gather on the control plane) is every rank's slot
    size, so every inter-stage activation and its gradient (same shape and dtype) fits (a 16 MiB
    fixed slot could not carry Llama-3-8B's 64 MiB activations)."""

    every_iteration = False

    def __init__(self, config: DelegationConfig):
        # checked before anything is built: its fields were checked by DelegationConfig itself
        self.config = instance_arg(config, "config", DelegationConfig,
                                   "a DelegationConfig (e.g. DelegationConfig(mode='auto'))")
        self.mode, self.failover = config.mode, config.failover
        self.slow_link_ms, self.detector = config.slow_link_ms, config.detector
        self.log: list[dict] = []
        self.slot_bytes = config.slot_bytes
        self._pool_args = dict(lanes=config.lanes, num_slots=config.slots, timeout_s=config.timeout_s)
        self._router_args = dict(failover=config.failover, recv_timeout_s=config.recv_timeout_s, faults=config.faults)
        self._delegating = False
        self.links: frozenset[frozenset[int]] | None = None
        """The PP links (pairs of global ranks) delegated while delegating; None: every link."""
        self._peers: frozenset[int] | None = None  # this rank's ends of ``links`` (None: every peer)
        self._started = False  # the pool's votes are taken (every PP rank, once)
        self.context: ScheduleContext | None = None
        self.pool: DelegatePool | None = None
        self.router: P2PRouter | None = None
        self.transport = DelegateTransport(self)
        self._bytes_prev = {"F": 0, "B": 0}
        self.unavailable: str | None = None  # why delegation went off for good (shared memory), or None
        self._seen = {"delegate": 0, "failover": 0}  # pool / router events already reported
        self._totals = (0, 0)  # (delegate restarts, failed-over link bits): the PP group's, last exchange
        self.step_failover: StepFailover | None = None
        """``failover`` on an NCCL PP group: per step, not per op (``StepFailover``); None otherwise."""

    def attach(self, context: ScheduleContext) -> None:
        """Bind to the schedule (its group, stage map, control plane, device layer, decision log).
        ``failover`` on an NCCL PP group is step-level (:class:`StepFailover`): the router retries nothing
        per op there (NCCL's rules forbid it: ``transport.NCCL_FAILOVER_REFUSAL``)."""
        self.context = context
        if self.failover and is_nccl(context.group):
            self._router_args["failover"] = False
            self.step_failover = StepFailover(self, context)

    def _ctx(self) -> ScheduleContext:
        if self.context is None:
            raise RuntimeError("Delegation is not attached to a schedule (pass it in the schedule's config)")
        return self.context

    @property
    def delegating(self) -> bool:
        return self._delegating

    def peers(self) -> frozenset[int] | None:
        """This rank's delegated peers (global ranks); None: every peer.  Derived from :attr:`links`
        once (it is read for every message)."""
        if self.links is not None and self._peers is None:
            me = dist.get_rank()
            self._peers = frozenset(p for link in self.links if me in link for p in link if p != me)
        return self._peers

    def delegates(self, peer: int) -> bool:
        """Whether messages to / from ``peer`` (global rank) go through the delegates now."""
        if not self._delegating:
            return False
        peers = self.peers()
        return peers is None or peer in peers

    def ensure_started(self, ops: list[dist.P2POp]) -> P2PRouter:
        """The router, starting the pool at the first op that needs it (every rank in the same
        iteration: delegation switches at agreed boundaries; failover routes from the first op)."""
        if self._started or self.unavailable is not None:
            return self.router
        if self.slot_bytes is None:
            local = max((op.tensor.numel() * op.tensor.element_size() for op in ops), default=0)
            self.slot_bytes = message_slot_bytes(max(self._ctx().control.gather_ints(local)))
        ctx = self._ctx()
        group = ctx.group
        rank = dist.get_rank()
        mapping = ctx.stage_to_rank()
        stage_to_rank = [mapping[s] for s in range(ctx.num_stages)]
        if group is not None:
            stage_to_rank = [dist.get_global_rank(group, r) for r in stage_to_rank]
        channels = pipeline_channels(rank, stage_to_rank)
        if self.links is not None and not self.failover:  # only the delegated links' channels
            channels = [ch for ch in channels if frozenset((ch.src, ch.dst)) in self.links]
        # the rings are reserved up front; a rank without the shared memory for them sends every rank
        # to the direct path (one vote, so none waits on a delegate that will never start)
        short = None
        try:
            check_shm(pool_shm_bytes(channels, self._pool_args["lanes"], self._pool_args["num_slots"],
                                     self.slot_bytes), f"the delegate rings of rank {rank}")
        except SharedMemoryShortage as e:
            short = str(e)
        if ctx.control.any(short is not None):
            self._go_direct(short or "another PP rank has too little shared memory for its delegate rings")
            return None
        self._started = True
        if not channels:  # no delegated link ends here: this rank's messages stay direct
            return None
        try:
            self.pool = DelegatePool(rank, channels, slot_bytes=self.slot_bytes, device=ctx.device(),
                                     **self._pool_args)
        except SharedMemoryShortage as e:  # taken between the check and the reservation: a clean stop
            raise DelegateError(f"delegation on rank {rank}: {e}") from None
        self.router = P2PRouter(rank, self.pool, group=group, delegating=self._delegating, **self._router_args)
        self.router.delegate_peers = self.peers()
        return self.router

    def _go_direct(self, why: str) -> None:
        """Delegation (and failover) off for good, on every rank alike: the PP messages go direct."""
        self.unavailable = why
        was = "delegation" if self._delegating or self.mode != "off" else "failover"
        self.mode, self._delegating, self.failover = "off", False, False
        if self.step_failover is not None:  # no delegates: an NCCL failure stops the job as without failover
            self.step_failover.close()
            self.step_failover = None
        log.warning("titan_ext: %s is off, PP messages go on the direct path: %s", was, why)
        self.log.append({"iteration": self._ctx().iteration(), "delegating": False, "reason": why})
        self._ctx().log(decision="delegation", reason=f"off (direct path): {why}")

    def start(self) -> None:
        """After the schedule's initial plan: ``always`` delegates from the first iteration."""
        if self.mode == "always":
            self.set(True, "delegation=always")

    def set(self, on: bool, reason: str = "external", completed: int | None = None,
            links: Any = None) -> None:
        """Switch delegation on/off.  Only between iterations; call it on every rank alike.
        ``completed``: iterations completed before the switch (default: the schedule's count).
        ``links``: turning on, the PP links to delegate — pairs of global ranks (e.g. the slow link
        Falcon's S3 moved onto a PP hop): their messages go through the delegates, every other link's
        stay direct, and only their ends start delegates; None: every link.  Fixed once the delegates
        started (the rings are reserved then)."""
        ctx = self._ctx()
        if ctx.in_iteration():
            raise RuntimeError("delegation can only be switched at an iteration boundary")
        if on == self._delegating:
            return
        if on and links is not None and not self._started:
            self.links = _links_arg(links)
            self._peers = None
        self._delegating = on
        if self.router is not None:
            self.router.delegating = on
        done = ctx.iteration() if completed is None else completed
        self.log.append({"iteration": done, "delegating": on, "reason": reason})
        ctx.log(decision="delegation", reason=f"{'on' if on else 'off'}: {reason}")

    def _slow_link(self, metrics: dict) -> tuple[bool, str]:
        if self.detector is not None:
            return bool(self.detector(metrics)), "detector"
        slow = {k: v for k, v in (metrics.get("link_delay_ms") or {}).items() if v == v and v > self.slow_link_ms}
        return bool(slow), f"slow links {slow} (> {self.slow_link_ms} ms)"

    def observe(self, boundary: Boundary) -> dict[str, Any]:
        if self.mode == "auto" and not self.delegating and boundary.exchanged:
            flagged, why = self._slow_link(boundary.metrics)
            if self._ctx().control.any(flagged):
                self.set(True, f"auto: {why if flagged else 'flagged by another rank'}",
                         completed=boundary.iteration + 1)
        restarts, failed_over = self._report(boundary)
        return {"delegating": self._delegating,
                "failed_over_links": failed_over,
                "delegate_restarts": restarts,
                "delegate_lanes_needed": self._lanes_needed(boundary.iteration_ms)}

    def _report(self, boundary: Boundary) -> tuple[int, list]:
        """Every delegate replacement (a dead or frozen delegate: its lane on the direct path, a new
        delegate started) and every failover (a direct transfer retried on the delegates) since the last
        boundary: a console WARNING and a decision-log row on the rank that saw it; the metrics carry
        the PP group's totals (``delegate_restarts``; ``failed_over_links``: every message direction of a
        PP link that failed over either way, ``"a->b"`` in PP ranks), gathered at each profile exchange so
        the logging rank reports faults on links it is not an end of."""
        router, ctx = self.router, self._ctx()
        if router is None and not (self._started and self.unavailable is None):
            return 0, []  # no delegates anywhere (every PP rank alike)
        # a started rank with no delegated link has no router but still takes part in the gather
        events = list(self.pool.fallback_events) if self.pool is not None else []
        for e in events[self._seen["delegate"]:]:
            where = f"{e['kind']} delegate {e['src']}->{e['dst']} lane {e['lane']}"
            if e["event"] == "fallback":
                why = (f"{where} {e.get('cause', 'died')} (exit {e.get('exit_code')}): its messages go on the direct "
                       f"path from seq {e.get('first_undelivered')} ({e.get('replayed', 0)} replayed)")
            elif e["event"] == "respawned":
                why = f"{where} replaced (epoch {e.get('epoch')}, pid {e.get('pid')})"
            elif e["event"] == "returned":
                why = f"{where} back on its new delegate from seq {e.get('from_seq')}"
            else:
                why = f"{where} {e['event']}: {e.get('error', '')}"
            (log.info if e["event"] == "returned" else log.warning)("titan_ext: delegate %s", why)
            ctx.log(decision=f"delegate_{e['event']}", reason=why)
        self._seen["delegate"] = len(events)
        failover_events = router.failover_events if router is not None else []
        for e in failover_events[self._seen["failover"]:]:
            why = f"link to rank {e['peer']} ({e['direction']}) failed over to the delegates: {e['reason']}"
            log.warning("titan_ext: %s", why)
            ctx.log(decision="delegate_failover", reason=why)
        self._seen["failover"] = len(failover_events)
        fell_back = {((e["dst"] if e["kind"].startswith("send") else e["src"]), e["kind"][-1])
                     for e in events if e["event"] == "fallback"}
        mask = self._link_mask(set(router.failed if router is not None else ()) | fell_back)
        restarts = sum(1 for e in events if e["event"] == "respawned")
        if boundary.exchanged:  # every rank alike: the group's totals
            rows = ctx.control.all_gather(torch.tensor([restarts, mask], dtype=torch.int64))
            total, union = 0, 0
            for r in rows:
                total, union = total + int(r[0]), union | int(r[1])
            self._totals = (total, union)
        total, union = self._totals
        union |= mask
        links = [f"{b // 2}->{b // 2 + 1}" if b % 2 == 0 else f"{b // 2 + 1}->{b // 2}"
                 for b in range(63) if union >> b & 1]
        return max(total, restarts), links

    def _link_mask(self, failed: set) -> int:
        """(peer global rank, direction) pairs as bits over the PP links: bit 2l = activations over link l
        (PP rank l -> l+1), bit 2l+1 = gradients (l+1 -> l)."""
        group = self._ctx().group
        me = dist.get_rank(group) if group is not None else dist.get_rank()
        mask = 0
        for peer, direction in failed:
            q = dist.get_group_rank(group, peer) if group is not None else peer
            if abs(q - me) == 1 and min(q, me) < 31:
                mask |= 1 << (2 * min(q, me) + (direction == "B"))
        return mask

    def _lanes_needed(self, iteration_ms: float) -> dict[str, int]:
        """§5.2 sizing from this iteration: production rate of each send kind (bytes handed to its
        delegates / iteration time) over the measured per-delegate throughput of that kind."""
        if self.router is None:
            return {}
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
        if self.step_failover is not None:
            self.step_failover.close()
        if self.pool is not None:
            self.pool.close()


# ------------------------------------------------------------------------------------------------
# failover of an NCCL PP group: per step
# ------------------------------------------------------------------------------------------------
_failover_instances = itertools.count()  # per process; every PP rank builds its schedules in the same order
_POLL_S = 0.05


def is_link_failure(exc: BaseException) -> bool:
    """An NCCL communicator error or abort (``DistBackendError``) or a PP wait past the timeout."""
    return isinstance(exc, (dist.DistBackendError, timeouts.PeerTimeout))


def abort_group(group: Any) -> None:
    """Abort this rank's communicator of ``group`` (``ProcessGroup.abort()``: its pending and later ops
    raise); idempotent, never raises."""
    target = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        target.abort()
    except Exception as exc:  # noqa: BLE001 - an already aborted or closed group
        log.debug("titan_ext: aborting the PP group: %s", exc)


class _Snapshot:
    """The stage modules' gradients and the CPU RNG state at the start of a step (:class:`StepFailover`, 4.)."""

    def __init__(self, stages: list) -> None:
        self.grads: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for stage in stages:
            for p in stage.submod.parameters():
                g = p.grad
                self.grads.append((p, None if g is None else g.detach().clone()))
        self.cpu_rng = torch.get_rng_state()

    def restore(self, stages: list) -> None:
        with torch.no_grad():
            for p, g in self.grads:
                if g is None:
                    p.grad = None
                elif p.grad is None:
                    p.grad = g.clone()
                else:  # in place (a gradient may be a view into a communication bucket); same device
                    p.grad.copy_(g, non_blocking=True)
        torch.set_rng_state(self.cpu_rng)
        for stage in stages:
            stage.clear_runtime_states()
            for name in ("bwd_cache", "backward_state", "dw_runner"):
                table = getattr(stage, name, None)
                if isinstance(table, dict):
                    table.clear()


class StepFailover:
    """Failover of an NCCL PP group to the delegates: the failed step re-run from its start (PipeMorph §5.3).

    On gloo, failover is per operation (:class:`~titan_ext.runtime.comm.delegate.transport.P2PRouter`): a direct
    send that fails is re-sent through the delegates from the thread that waits on it.  NCCL forbids that
    (a pair's ops run in issue order from one thread, tags are ignored, a hung send does not raise from
    ``wait()``), so on an NCCL PP group failover works per *step*:

    1. **Detection.**  A PP link's NCCL path fails when a communicator error or abort surfaces from a PP op
       or its wait (``torch.distributed.DistBackendError``: ProcessGroupNCCL's errors, and the ``nccl_rules``
       test backend's ``CommunicatorAborted``), or when a PP wait runs past the job's timeout
       (:mod:`titan_ext.runtime.comm.timeouts`' watch calls :meth:`StepFailover._late` before NCCL's watchdog would
       end the process; this aborts the PP group locally, so the wait raises).
    2. **Unblocking the other ranks.**  The rank that sees it puts a notice in the job's TCPStore and aborts
       its own PP communicator (``ProcessGroup.abort()``: every pending op of the group raises, later ones
       too).  Every rank runs a watch thread while a step runs (one ``store.check`` every 50 ms); a rank that
       sees the notice aborts its PP communicator too, so none stays blocked on a peer that left the step.
    3. **Agreement at a safe point.**  At the end of every step (every rank reaches it: the step either
       completed, or its failure was caught) the PP ranks take one MAX vote on the gloo control plane
       (:mod:`titan_ext.runtime.comm.control_plane`): did any rank see a failure?  No: the step stands.  Yes: every rank
       aborts its PP communicator (its ops of the failed attempt are dropped), moves **every** link to the
       delegates (``Delegation.set(True)``), restores the stage modules' gradients and the CPU RNG state to what
       they were when the step began, clears the stages' per-step state, and re-runs the step from its start
       with the same microbatches.  The vote is taken only while some link is on NCCL; after the failover
       there is none.
    4. **Gradients.**  ``step()`` accumulates into ``param.grad`` (TorchTitan zeroes the gradients before its
       train step; with gradient accumulation they hold earlier steps' sums).  The schedule sees only its own
       microbatches, so the re-run must start from the gradients the step began with: at the start of every
       step the stage modules' gradients are recorded — a parameter whose ``.grad`` is None (the common case
       right after ``zero_grad()``, TorchTitan's default ``set_to_none``) costs nothing, restored by setting it
       to None again; an existing gradient is cloned (one copy of the gradients per step, only when the step
       begins with gradients) and copied back on a re-run.  The CPU RNG state is recorded too, so CPU
       random draws repeat on the re-run.

    Why every link on the delegates, not a new NCCL PP group for the healthy links: an aborted communicator
    is the group's, i.e. every link of the PP group (``batch_isend_irecv`` runs on the group's communicator),
    an NCCL error does not say which link failed, and a new group is a job-wide call (``new_group`` over the
    default group, or ``use_local_synchronization=True`` by every PP rank) whose handle TorchTitan also holds
    (its PP mesh's collectives, e.g. the gradient-norm all-reduce): the delegates need nothing NCCL gives,
    and they exist already (the pool is started at the first PP op when failover is configured).  The
    healthy links lose their GPU-direct path (host-staged from then on).

    Limits: module buffers updated in forward (BatchNorm's running statistics) are not restored, nor the
    device's RNG (a CUDA call outside the device layer: a model with dropout on a GPU draws other masks in
    the re-run; TorchTitan's Llama models use none); FSDP stages' unshard state is not either (the failed
    attempt's unshard/reshard is redone by the re-run's actions).
    """

    def __init__(self, delegation: Any, context: Any):
        self.delegation, self.context = delegation, context
        self.active = True  # some PP link still on NCCL
        self.events: list[dict] = []  # one per failover: iteration, rank that saw it first, reason
        group = context.group
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self._key = f"titan_ext/pp_failover/{'-'.join(map(str, ranks))}/{next(_failover_instances)}"
        self._store = timeouts._default_store()
        self._running = threading.Event()  # a step runs: the watch thread polls the store
        self._noticed = threading.Event()  # some rank posted the notice (this rank's PP group is aborted)
        self._reason: str | None = None
        self._snapshot: _Snapshot | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._remove_hook = timeouts.on_late_p2p(self._late)

    # --- the step --------------------------------------------------------------------------------
    def _needed(self) -> bool:
        """Some PP link is on NCCL now (not once every link is delegated: ``delegation="always"``, after
        an auto switch, or after this failover).  The same on every rank: switches happen at agreed
        boundaries."""
        d = self.delegation
        return self.active and not (d.delegating and d.links is None)

    def begin(self, stages: list) -> None:
        """At the start of a step (first attempt): record gradients and RNG state, watch for notices."""
        self._snapshot = None
        if not self._needed():
            return
        self._snapshot = _Snapshot(stages)
        if self._thread is None and self._store is not None:
            self._thread = threading.Thread(target=self._watch, daemon=True, name="titan_ext-pp-failover")
            self._thread.start()
        self._running.set()

    def failed(self, exc: BaseException) -> bool:
        """The step raised ``exc``: a failure of the NCCL path (this rank posts the notice and aborts its
        PP communicator; the step is settled by :meth:`settle`), or not (raise it)."""
        if not self._needed() or not (is_link_failure(exc) or self._noticed.is_set()):
            return False
        self._notify(f"rank {dist.get_rank()}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return True

    def settle(self, stages: list) -> bool:
        """End of a step attempt, on every PP rank: the vote.  True: the NCCL path failed on some rank and
        every link is now on the delegates — re-run the step (gradients and stage state restored)."""
        if not self._needed():
            self._running.clear()
            return False
        ctx = self.context
        # the watch keeps polling through the vote: a rank whose step completed may still have PP ops in
        # flight to a rank that left the step (a stream wait behind them holds its next kernel) — the
        # notice aborts them
        failed = ctx.control.any(self._noticed.is_set())
        self._running.clear()
        if not failed:
            return False
        abort_group(ctx.group)
        reason = self._reason or self._read_notice()
        iteration = ctx.iteration()
        self.active = False
        self._close_watch()
        d = self.delegation
        why = (f"NCCL path of the PP group failed in iteration {iteration} ({reason}): every PP link moved to "
               f"the delegates, the iteration re-runs from its start")
        log.warning("titan_ext: %s", why)
        self.events.append({"iteration": iteration, "reason": reason, "time": time.time()})
        if d.router is not None:
            for ch in d.pool.channels if d.pool is not None else ():
                peer = ch.dst if ch.src == dist.get_rank() else ch.src
                d.router._fail_over(peer, ch.direction, f"NCCL path failed in iteration {iteration}: {reason}")
        d.set(True, f"failover: {why}", completed=iteration)
        if self._snapshot is not None:
            self._snapshot.restore(stages)
        return True

    # --- notices ---------------------------------------------------------------------------------
    def _notify(self, reason: str) -> None:
        if not self._noticed.is_set():
            self._reason = reason
            if self._store is not None:
                try:
                    self._store.set(self._key, reason)
                except Exception as exc:  # noqa: BLE001 - the vote still carries this rank's failure
                    log.debug("titan_ext: failover notice: %s", exc)
            self._noticed.set()
        abort_group(self.context.group)

    def _read_notice(self) -> str:
        """The notice's reason (``check`` first: a ``get`` of a missing key would wait for it)."""
        try:
            if self._store is not None and self._store.check([self._key]):
                return self._store.get(self._key).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the store is going away: the vote is what counts
            pass
        return "another PP rank saw the failure"

    def _watch(self) -> None:
        while not self._closed:
            self._running.wait()
            if self._closed:
                return
            try:
                seen = self._store.check([self._key])
            except Exception:  # noqa: BLE001 - the store is going away
                return
            if seen and self._running.is_set() and not self._noticed.is_set():
                self._noticed.set()
                abort_group(self.context.group)
            time.sleep(_POLL_S)

    def _late(self, work: Any) -> bool:
        """:mod:`~titan_ext.runtime.comm.timeouts`' watch: a PP wait ran past the timeout while a step ran."""
        if not (self.active and self._running.is_set()):
            return False
        self._notify(f"rank {dist.get_rank()}: no {getattr(work, 'kind', 'message')} completed with rank "
                     f"{getattr(work, 'peer', '?')} within the PP timeout")
        return True

    def _close_watch(self) -> None:
        self._closed = True
        self._running.set()
        self._remove_hook()

    def close(self) -> None:
        self.active = False
        if not self._closed:
            self._close_watch()
