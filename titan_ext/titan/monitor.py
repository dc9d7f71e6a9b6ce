"""Measured pipeline timeline and per-step pipeline metrics, for any schedule.

:class:`PipelineMonitor` wraps the compute entry points of the local ``PipelineStage`` objects
(``forward_one_chunk`` → F, ``backward_one_chunk`` → B (full) or I (input-only),
``backward_weight_one_chunk`` → W) and the schedule's ``step``.  On CPU every call records start/end on
``time.monotonic_ns()`` -- one clock read per action edge, no collective and no device sync on the
critical path.  On a GPU the host span would be the launch span, so the monitor times through the device
layer (``titan_ext.runtime.execute.device``): CUDA events on the stage's compute stream, put on the host clock
through an anchor whose completion was stamped, and read only in :meth:`PipelineMonitor.gather` (a
logging step), so ``pipeline/*`` metrics are device timings for every schedule.

On a logging step, :meth:`PipelineMonitor.gather` does one ``all_gather_object`` over the PP group
(outside the measured iteration) and every rank obtains the whole iteration's timeline, from which:

* ``iteration_ms`` = T, from the first F on stage 0 to the last action end anywhere;
* ``bubble_rate`` = 1 - Σ busy / (P · T)  (DESIGN.md's definition; P = number of PP ranks, which
  is the number of stages S for one-stage-per-rank schedules);
* ``link_delay_ms[i]`` (measured, for every schedule) = the one measured link delay
  (``runtime.measure.profiler.one_way_delay_ms``, the runtime's rule) of the gaps between a producer's
  end and its consumer's start over all microbatches, forward (F on stage i → F on stage i+1) and
  backward (B/I on stage i+1 → B/I on stage i): each direction's smallest gap, the mean of the two
  directions (before: the smaller of the two, which the runtime's c_i is not). Every such
  gap is ≥ the one-way delivery time of the message, and equals it (plus the receive overhead)
  whenever the consumer was already waiting for that message; it is therefore an upper bound that is
  tight under a straggler (the consumer waits on the slow link), and may overestimate a fast link in
  a schedule where every consumer is busy when data arrives.

Clocks: all ranks of one host share CLOCK_MONOTONIC, so their timestamps are comparable exactly. When
the PP group spans hosts, the offset of each rank's clock against PP rank 0 is estimated once at start
from the exit times of 5 barriers (median); its error is the barrier's exit skew (typically well
below a millisecond on a LAN, i.e. small against multi-ms actions).
"""

import math
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from titan_ext.plan.ir import TimedAction
from titan_ext.plan.timing import bubble_rate
from titan_ext.runtime.execute.device import DeviceLayer, device_layer
from titan_ext.runtime.measure.profiler import ActionRecord, one_way_delay_ms

__all__ = ["Action", "IterationTimeline", "PipelineMonitor", "timeline_stats"]


@dataclass(init=False, unsafe_hash=True)
class Action(TimedAction):
    """A measured action of the iteration's timeline: the one record (``plan.ir.TimedAction``), times in
    integer ns (``start_ns`` / ``end_ns``); constructed ``Action(stage, kind, microbatch, start_ns, end_ns)``."""

    def __init__(self, stage: int, kind: str, microbatch: int, start_ns: int, end_ns: int):
        TimedAction.__init__(self, stage, kind, microbatch, start_ns, end_ns)

    start_ns = property(lambda self: self.start, doc="start, ns")
    end_ns = property(lambda self: self.end, doc="end, ns")


@dataclass
class IterationTimeline:
    """All ranks' actions of one iteration on one (aligned) clock."""

    step: int
    num_stages: int
    actions: list[Action]
    num_ranks: int = 0  # PP ranks (devices); 0 = one stage per rank
    step_wall_ms: dict[int, float] = field(default_factory=dict)  # per PP rank: wall of step()

    def to_rows(self) -> list[dict[str, Any]]:
        t0 = min(a.start_ns for a in self.actions) if self.actions else 0
        return [
            {"stage": a.stage, "kind": a.kind, "microbatch": a.microbatch,
             "start_ms": (a.start_ns - t0) / 1e6, "end_ms": (a.end_ns - t0) / 1e6}
            for a in self.actions
        ]


def timeline_stats(timeline: IterationTimeline) -> dict[str, Any]:
    """iteration_ms, bubble_rate, busy_ms per stage and measured link delays (see module doc)."""
    acts = timeline.actions
    S = timeline.num_stages
    P = timeline.num_ranks or S
    if not acts:
        return {"iteration_ms": float("nan"), "bubble_rate": float("nan"), "link_delay_ms": {}}
    firsts = [a.start_ns for a in acts if a.stage == 0 and a.kind == "F"]
    t_start = min(firsts) if firsts else min(a.start_ns for a in acts)
    t_end = max(a.end_ns for a in acts)
    T = max(t_end - t_start, 1)
    busy = {s: 0 for s in range(S)}
    for a in acts:
        busy[a.stage] = busy.get(a.stage, 0) + (a.end_ns - a.start_ns)
    bubble = bubble_rate(sum(busy.values()), P, T)

    by_key: dict[tuple[int, str, int], Action] = {(a.stage, a.kind, a.microbatch): a for a in acts}
    links: dict[int, float] = {}
    for link in range(S - 1):
        fwd, bwd = [], []  # one-way samples (s) per direction, on one (aligned) clock
        for (stage, kind, mb), a in by_key.items():
            if stage == link and kind == "F":
                nxt = by_key.get((link + 1, "F", mb))
                if nxt is not None:
                    fwd.append((nxt.start_ns - a.end_ns) / 1e9)
            if stage == link + 1 and kind in ("B", "I"):
                prev = by_key.get((link, "B", mb)) or by_key.get((link, "I", mb))
                if prev is not None:
                    bwd.append((prev.start_ns - a.end_ns) / 1e9)
        if fwd or bwd:
            links[link] = one_way_delay_ms(fwd, bwd)
    return {
        "iteration_ms": T / 1e6,
        "bubble_rate": bubble,
        "busy_ms": {s: b / 1e6 for s, b in busy.items()},
        "link_delay_ms": links,
    }


class PipelineMonitor:
    """Records this rank's compute actions in ``schedule.step()``; gathers them on demand."""

    def __init__(self, schedule: Any, pp_group: dist.ProcessGroup | None = None,
                 clock: Callable[[], int] = time.monotonic_ns, layer: DeviceLayer | None = None):
        self.schedule = schedule
        self.pp_group = pp_group
        self._clock = clock
        self.stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
        self.num_stages = self.stages[0].num_stages
        if layer is None and torch.device(getattr(self.stages[0], "device", "cpu")).type == "cuda":
            layer = device_layer(self.stages[0].device)
        #: device timing (events) on an asynchronous device; None: the host clock times the device
        self._timer = layer.timer() if layer is not None and layer.asynchronous else None
        self._layer = layer
        self._records: list[ActionRecord] = []
        self._actions: list[Action] = []
        self._last_actions: list[Action] = []
        self._step_start = 0
        self.last_step_wall_ms = float("nan")
        for stage in self.stages:
            self._wrap_stage(stage)
        self._wrap_step()
        self.clock_offset_ns = self._estimate_clock_offset()

    # -- recording -------------------------------------------------------------------------
    def _record(self, stage_index: int, kind: str, mb: int, fn, *args, **kwargs):
        if self._timer is not None:
            rec = ActionRecord(kind, stage_index, int(mb))  # the runtime profiler's record
            token = self._timer.start(rec)
            try:
                return fn(*args, **kwargs)
            finally:
                self._timer.stop(rec, token)
                self._records.append(rec)
        t0 = self._clock()
        try:
            return fn(*args, **kwargs)
        finally:
            self._actions.append(Action(stage_index, kind, int(mb), t0, self._clock()))

    def _wrap_stage(self, stage) -> None:
        idx = stage.stage_index
        fwd, bwd, bwd_w = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

        def forward_one_chunk(fwd_chunk_id, *args, **kwargs):
            return self._record(idx, "F", fwd_chunk_id, fwd, fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            return self._record(idx, "B" if full_backward else "I", bwd_chunk_id, bwd, bwd_chunk_id,
                                loss=loss, full_backward=full_backward, last_backward=last_backward)

        def backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs):
            return self._record(idx, "W", bwd_chunk_id, bwd_w, bwd_chunk_id, *args, **kwargs)

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk

    def _wrap_step(self) -> None:
        step = self.schedule.step

        def wrapped_step(*args, **kwargs):
            self._actions = []
            t0 = self._step_start = self._clock()
            if self._timer is not None:  # the previous step's events are not needed: no host sync
                self._timer.discard()
                self._records = []
                with self._layer.context():
                    self._timer.begin_iteration()
            try:
                return step(*args, **kwargs)
            finally:
                if self._timer is not None:
                    with self._layer.context():
                        self._timer.end_iteration()
                    self.last_step_wall_ms = math.nan  # read from the events in gather()
                else:
                    self.last_step_wall_ms = (self._clock() - t0) / 1e6
                self._last_actions = self._actions

        self.schedule.step = wrapped_step

    def since_step_start_ms(self) -> float:
        """ms since the last ``step()`` began (at logging time: the train step, optimizer included)."""
        return (self._clock() - self._step_start) / 1e6

    # -- clocks ----------------------------------------------------------------------------
    def _estimate_clock_offset(self) -> int:
        if self.pp_group is None or not dist.is_initialized():
            return 0
        hosts: list[Any] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(hosts, socket.gethostname(), group=self.pp_group)
        if len(set(hosts)) == 1:
            return 0  # one host: CLOCK_MONOTONIC is shared by all processes
        samples = []
        for _ in range(5):
            dist.barrier(group=self.pp_group)
            t = self._clock()  # stamped at barrier exit; exchanged afterwards
            ts: list[Any] = [None] * len(hosts)
            dist.all_gather_object(ts, t, group=self.pp_group)  # works on gloo and NCCL groups
            samples.append(t - ts[0])
        return int(statistics.median(samples))

    # -- gathering -------------------------------------------------------------------------
    def _resolve_device_times(self) -> None:
        """Device timing: wait for the last step's last event (a logging step, never a device
        synchronize) and turn its records into actions on the host clock (ns)."""
        if self._timer is None or not self._records:
            return
        with self._layer.context():
            self._timer.resolve(block=True)
        self.last_step_wall_ms = self._timer.wall_ms
        self._last_actions = [Action(r.stage, r.kind, r.microbatch, int(r.start * 1e9), int(r.end * 1e9))
                              for r in self._records]
        self._records = []

    def local_actions(self) -> list[Action]:
        """This rank's actions of the last completed ``step()``, on PP rank 0's clock."""
        self._resolve_device_times()
        off = self.clock_offset_ns
        return [Action(a.stage, a.kind, a.microbatch, a.start_ns - off, a.end_ns - off)
                for a in self._last_actions]

    def gather(self, step: int) -> IterationTimeline:
        """Collective over the PP group (every PP rank must call it at the same step)."""
        actions = self.local_actions()
        mine = (actions, self.last_step_wall_ms)
        if self.pp_group is None or not dist.is_initialized():
            parts = [mine]
        else:
            from titan_ext.runtime.comm.timeouts import named

            parts = [None] * dist.get_world_size(self.pp_group)
            named(self.pp_group, "monitor/gather",  # a timeout names the rank that did not come
                  lambda: dist.all_gather_object(parts, mine, group=self.pp_group))
        actions = sorted((a for p in parts for a in p[0]), key=lambda a: (a.start_ns, a.stage))
        return IterationTimeline(step=step, num_stages=self.num_stages, actions=actions,
                                 num_ranks=len(parts),
                                 step_wall_ms={r: p[1] for r, p in enumerate(parts)})
