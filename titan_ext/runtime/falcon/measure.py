"""What Falcon measures in the DP x PP job (Falcon §4.2-§4.3): the iteration time and per-group
times of every step (the same numbers on every rank, so all take the same decision), the ACF
iteration time from the call record, and validation on onset.

**No device sync in a steady step**.  Falcon-Detect is non-intrusive (§4.1-§4.2: a shim
logs the calls, a LocalAnalyzer on the node infers the iteration times off the training path, and
the detector costs 0.39 % on average, §7.4): nothing in the step waits for the device.  Here

* a step's device times (its span, the DP sync's marks) are device-layer timing events
  (:class:`StepClock`, :meth:`~titan_ext.runtime.execute.device.Timer.resolve` with ``block=False``) read
  once the device ran them — at the step's own end on the CPU (the host clock is the device's), a
  step or more later on a GPU whose device runs behind the host — never an ``Event.synchronize``;
* the ranks agree on the steps every rank has read through **one MAX reduction a check** on the
  control group (:class:`ObservationExchange`, every ``falcon_check_every`` steps and at the last one;
  recursive doubling, log2 n message rounds; a host wait on the other ranks' hosts, which are
  ahead of their devices too — no device work waits on it), so the detector sees the same series as
  Falcon's, every step, in order, on every rank, at the same boundary: on the CPU at the check after
  the step, on a GPU one or two steps later when the device ran behind (Falcon's own detection takes
  tens of iterations: §7.2).  A device more than
  :data:`STEPS_IN_FLIGHT` steps behind the host makes the host wait for the oldest step's last event
  (the device still has the later steps queued: it is not idled) — the documented bound of the
  host's run-ahead;
* a step measured under a layout or split that a decision has changed since it *started* is not fed
  to the detector (:meth:`~titan_ext.titan.falcon_job.FalconJob._after_step`): the monitor's comparisons before and after a
  mitigation see only steps of one configuration, however late the device times arrive.

Host data goes on gloo control groups; ring-validation buffers on the device, over the groups
whose communicators exist (:func:`validate`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from titan_ext.runtime.falcon.decision import FalconDecision, IterationObservation
from titan_ext.runtime.falcon.exchange import max_all_reduce
from titan_ext.runtime.falcon.validation import gemm_probe, validate_rings
from titan_ext.runtime.comm.timeouts import named

__all__ = ["SLOW_DEVICE_RATIO", "STEPS_IN_FLIGHT", "StepClock", "StepRecord", "ObservationExchange",
           "acf_iteration_times", "validate", "rings_to_validate"]

SLOW_DEVICE_RATIO = 1.5
"""GEMM probe: a device slower than 1.5 x the median is slow. Falcon's 1.1 is for dedicated GPUs; on
a time-shared CPU host the fastest of 10 probe repeats of a healthy rank still varies by more than
10 % (and the emulated slow devices here are >= 2x)."""
VALIDATION_BYTES = 1 << 22
"""Validation messages (4 MB): large enough that a link F x slower in bandwidth (``A-B:xF``) shows
more than the monitor's 2 ms minimum excess on loopback."""
STEPS_IN_FLIGHT = 4
"""Steps whose device times may be unread at once (one device-layer timer each): a device further
behind makes the host wait for the oldest one's last event (:meth:`StepClock.start`)."""


class StepRecord:
    """One step of this rank: its timer while in flight, then its device times (seconds: ``seconds``
    the step's span, ``at[name]`` the host-clock time of each :meth:`StepClock.mark`), and the host
    values the step ran with (``host``: the split, this rank's place in the grid, the PP link delays,
    the trainer's step)."""

    __slots__ = ("index", "timer", "stamps", "seconds", "at", "host")

    def __init__(self, index: int, timer: Any):
        self.index, self.timer = index, timer
        self.stamps: dict[str, list[float]] = {}
        self.seconds = math.nan
        self.at: dict[str, float] = {}
        self.host: dict[str, Any] = {}

    @property
    def read(self) -> bool:
        return self.timer is None

    def span_s(self, first: str, last: str) -> float:
        """Device time between two marks of the step (NaN when one is missing)."""
        return self.at.get(last, math.nan) - self.at.get(first, math.nan)


class StepClock:
    """A training step's *device* time, the detector's input (Falcon §4.2 detects fail-slow in the
    iteration time; a slow GPU shows in the time the device took, not in the host's enqueueing),
    and the device times of marks inside it (the DP sync's, :class:`~titan_ext.titan.falcon_dp.DPSync`).

    Timed by the device layer (:func:`titan_ext.runtime.execute.device.device_layer`): on CUDA, events on the
    compute stream bracket the step and its marks; they are read with ``resolve(block=False)`` once the
    device ran them (:meth:`read`, at the step's end: usually the step before's), never with a wait —
    a backlog the device carries into or through the step is in the step's time, the host's run-ahead
    is not.  On CPU the host clock is the device clock and a step is read at its end.

    One device-layer timer per step in flight (:data:`STEPS_IN_FLIGHT`), each primed at start-up (the
    first anchor of a CUDA timer waits on its own event once: start-up, off the steady state)."""

    def __init__(self, device: Any, in_flight: int = STEPS_IN_FLIGHT):
        from titan_ext.runtime.execute.device import device_layer

        layer = device_layer(device if device is not None else "cpu")
        self._free = deque(layer.timer() for _ in range(max(1, in_flight)))
        for timer in self._free:  # start-up: each timer's first anchor
            timer.begin_iteration()
            timer.end_iteration()
            timer.resolve(block=True)
        self._open: StepRecord | None = None
        self._ended: deque[StepRecord] = deque()
        self.forced_reads = 0
        """Steps read by waiting: the device was :data:`STEPS_IN_FLIGHT` steps behind the host."""

    def start(self, index: int) -> StepRecord:
        """Begin step ``index`` on the compute stream (a timer of a step already read; with none
        free, the oldest step in flight is read by waiting for its last event — the device is then
        :data:`STEPS_IN_FLIGHT` steps behind, and still has the later ones queued)."""
        if not self._free:
            self.forced_reads += 1
            self._read(self._ended[0], block=True)
        timer = self._free.popleft()
        timer.begin_iteration()
        self._open = StepRecord(index, timer)
        return self._open

    def mark(self, name: str) -> None:
        """This point of the compute stream in the open step (no step open: nothing)."""
        step = self._open
        if step is not None:
            step.stamps[name] = []
            step.timer.mark(step.stamps[name])

    def stop(self) -> StepRecord:
        """End the open step on the compute stream; its times are read later (:meth:`read`)."""
        step, self._open = self._open, None
        step.timer.end_iteration()
        self._ended.append(step)
        return step

    def read(self) -> list[StepRecord]:
        """The ended steps whose device work completed, oldest first, read without waiting."""
        out = []
        while self._ended and self._read(self._ended[0], block=False):
            out.append(self._ended.popleft())
        return out

    def drain(self) -> list[StepRecord]:
        """Every ended step, oldest first, read by *waiting* for the device: the job's last step only
        (its steps are fed before training ends), never a steady one."""
        out = []
        while self._ended:
            self._read(self._ended[0], block=True)
            out.append(self._ended.popleft())
        return out

    def _read(self, step: StepRecord, block: bool) -> bool:
        timer = step.timer
        if timer is None:
            return True
        if not timer.resolve(block=block):
            return False
        step.seconds = timer.wall_ms / 1e3
        step.at = {name: stamps[0] for name, stamps in step.stamps.items() if stamps}
        step.timer = None
        self._free.append(timer)
        return True

    def stop_s(self) -> float:
        """:meth:`stop` and the step's device time, *waiting* for it (start-up and tests only)."""
        step = self.stop()
        while not step.read:
            self._read(self._ended[0], block=True)
            self._ended.popleft()
        return step.seconds


class ObservationExchange:
    """The steps' observations, the same on every rank (Falcon §4.2's iteration time and §4.3's
    per-group times), exchanged with **one MAX reduction a check** on the gloo ``control`` group
    (:meth:`exchange`; a host tensor: no device work waits on it), by recursive doubling
    (:func:`~titan_ext.runtime.falcon.exchange.max_all_reduce`: ⌊log2 n⌋ message rounds, where gloo's
    ring ``all_reduce`` takes 2 (n − 1)).

    The vector holds a window of steps (from the first one not fed yet: every step since the previous
    check and those a device running behind the host has not finished), each a slot of MAX-reduced
    numbers: the step's index, whether a rank has not read it yet, the iteration time (the slowest
    rank's step, §4.2), per stage the DP sync's and its all-reduce's times (MIN over the stage's
    members, sent negated: §4.3's *transfer* time, the last to arrive waited for no one), per
    replica its PP link delays (as PipeMorph measured them) and its compute phase (§5.3's t_i, S2's
    Eq. 1 input).  A step whose slot every rank filled is complete; complete steps are returned in
    order, each once, the same on every rank.

    ``every``: the check cadence (steps a check; the window holds ``every`` + :data:`STEPS_IN_FLIGHT`
    + 1 slots, so the steps unread at one check fit in the next).  ``ranks``: the control group's
    ranks in pairing order (:meth:`order`; None: the group's order).  ``algorithm``: ``"doubling"``,
    or ``"ring"`` (gloo's ``all_reduce``: the exchange before, kept for the benchmark's comparison).
    ``reductions`` counts the exchanges run."""

    def __init__(self, control: Any, num_pp: int, num_dp: int, every: int = 1, window: int | None = None,
                 algorithm: str = "doubling"):
        if algorithm not in ("doubling", "ring"):
            raise ValueError(f"algorithm {algorithm!r}: 'doubling' or 'ring'")
        self.control, self.S, self.D, self.algorithm = control, num_pp, num_dp, algorithm
        self.window = window if window is not None else max(1, int(every)) + STEPS_IN_FLIGHT + 1
        self.width = 2 + 1 + 2 * num_pp + num_dp * (num_pp - 1) + num_dp
        self.fed_through = -1
        """Every step up to this index was returned by :meth:`exchange`."""
        self.ranks: list[int] | None = None
        self.reductions = 0
        self._mine: dict[int, StepRecord] = {}

    def order(self, grid: list[list[int]]) -> None:
        """Pair the ranks by the grid, row by row: a pipeline's ranks adjacent, so the first rounds
        stay within each PP group and the last ones pair the groups (the same list on every rank)."""
        self.ranks = [int(r) for row in grid for r in row]

    def add(self, step: StepRecord) -> None:
        """A step this rank ran (its numbers are sent once it is read)."""
        self._mine[step.index] = step

    def exchange(self) -> list[tuple[StepRecord, IterationObservation, list[float]]]:
        """Every rank's complete steps (``(step, observation, each stage's DP all-reduce time)``,
        oldest first): the steps not fed yet, exchanged now (a timeout names the silent rank)."""
        vec = self._vector()
        if self.algorithm == "ring":
            run = lambda: dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=self.control)  # noqa: E731
        else:
            run = lambda: max_all_reduce(vec, self.control, self.ranks)  # noqa: E731
        named(self.control, "falcon/step", run)
        self.reductions += 1
        return self._complete(vec)

    def _vector(self) -> torch.Tensor:
        S, D = self.S, self.D
        first = self.fed_through + 1
        vec = torch.full((self.window, self.width), -math.inf, dtype=torch.float64)
        for slot in range(self.window):
            j = first + slot
            row = vec[slot]
            row[0] = j
            step = self._mine.get(j)
            if step is None or not step.read:
                row[1] = 1.0  # not read here (yet): the slot is incomplete
                continue
            row[1] = 0.0
            h = step.host
            dp_i, pp_i = h["dp_index"], h["pp_index"]
            row[2] = step.seconds
            row[3 + pp_i] = -_finite(step.span_s("dp_start", "dp_end"))  # MIN, sent negated
            row[3 + S + pp_i] = -_finite(step.span_s("dp_reduce", "dp_end"))
            links = 3 + 2 * S + dp_i * (S - 1)
            for i, ms in h.get("link_delay_ms", {}).items():
                if 0 <= int(i) < S - 1 and ms == ms:  # not NaN
                    row[links + int(i)] = max(0.0, float(ms)) / 1e3
            compute = step.span_s("step_start", "dp_start")
            if compute == compute:
                row[3 + 2 * S + D * (S - 1) + dp_i] = compute
        return vec

    def _complete(self, vec: torch.Tensor) -> list[tuple[StepRecord, IterationObservation, list[float]]]:
        S, D = self.S, self.D
        out = []
        for row in vec.tolist():
            j = int(row[0])
            if j != self.fed_through + 1 or row[1] != 0.0:
                break
            step = self._mine.pop(j)
            sync = [_inf_to_nan(-t) for t in row[3:3 + S]]
            reduce = [_inf_to_nan(-t) for t in row[3 + S:3 + 2 * S]]
            groups = {f"dp_stage{s}": _or_zero(sync[s]) for s in range(S)}
            links = row[3 + 2 * S:3 + 2 * S + D * (S - 1)]
            groups |= {f"pp{d}_link{i}": max(0.0, links[d * (S - 1) + i]) for d in range(D) for i in range(S - 1)}
            compute = row[3 + 2 * S + D * (S - 1):]
            split = step.host["split"]
            out.append((step, IterationObservation(
                row[2], groups, replica_microbatch_s=tuple(_inf_to_nan(compute[d]) / split[d] for d in range(D)),
                split=tuple(split)), reduce))
            self.fed_through = j
        return out


def _finite(x: float) -> float:
    return x if math.isfinite(x) else math.inf  # a missing time: no part in the MIN


def _inf_to_nan(x: float) -> float:
    return x if math.isfinite(x) else math.nan


def _or_zero(x: float) -> float:
    return x if x == x else 0.0


def acf_iteration_times(monitor: Any) -> dict:
    """Falcon §4.2's framework-agnostic iteration time, next to the trainer's: the ACF period of
    this rank's torch.distributed call record (:class:`~titan_ext.runtime.falcon.hooks.CallRecorder`,
    started after the first step, whose one-off calls would hide the period) and the time
    between a call and its occurrence one period earlier. Logged as ``falcon/acf_*``; the
    detector is fed the trainer's step time, which is exact here and has no gap while the
    period is re-learned after a change of the call pattern (S2's new split, a re-plan)."""
    from titan_ext.runtime.falcon.hooks import CallRecorder

    if monitor.recorder is None:
        monitor.attach_recorder(CallRecorder().start())
        return {}
    times = monitor.iteration_times_from_recorder()
    out = {"falcon/acf_period_calls": monitor.period_calls}
    if times:
        out["falcon/acf_iteration_time_s"] = float(times[-1])
    return out


def validate(monitor: Any, *, grid: list[list[int]], emulation: Any, control: Any, device: Any,
             ring_groups: dict | None = None) -> FalconDecision:
    """Falcon §4.3 validation (training pauses until it returns): ring passes over the groups
    profiling flagged (:func:`rings_to_validate`, from ``monitor.suspicious``) and one unflagged ring
    as the healthy reference — timed a second time when a link looks slow, a link's time then the
    faster of its two (slow only if slow in both rounds) — then the GEMM probe on every rank; the
    monitor's verdict on them.

    Every ring is a pipeline (a PP group) or a DP column (a DP group); ``ring_groups`` maps
    ``frozenset(ring)`` to that group (only the rings this rank is in are needed).  §4.3 measures
    the *link* a collective uses, GPU to GPU: the passes run on the device, as batched P2P ops on the
    ring's own group, whose NCCL communicator exists (ProcessGroupNCCL's ``pointToPoint`` selects the
    group's communicator for a batched op, a two-rank one for a bare ``send``/``recv``, created at
    first use — at the moment of diagnosis, a blocking rendezvous and more device memory): see
    :func:`~titan_ext.runtime.falcon.validation.validate_passes`."""
    t0 = time.perf_counter()
    rings = rings_to_validate(grid, monitor.suspicious)
    # one ring profiling did not flag is timed too: the healthy reference a flagged ring's links
    # are compared with (all links of a lone flagged ring are slow: their own median hides them)
    reference = [r for r in rings_to_validate(grid, []) if r not in rings][:1]
    timed = [r for r in rings + reference if len(r) > 1]
    comms = None if ring_groups is None else [ring_groups.get(frozenset(r)) for r in timed]
    links = _time_rings(timed, comms, emulation, control, device)
    if monitor.slow_links_in(*_suspects_and_reference(links, rings, reference)):
        # a second round before a link is called slow: a slow link is slow in both, while a loaded
        # host's scheduling noise (seen: one direction of a healthy DP link flagged, then S3
        # applied in a healthy run) rarely repeats; every rank holds the same times, so all agree
        again = _time_rings(timed, comms, emulation, control, device)
        links = {k: min(t, again.get(k, t)) for k, t in links.items()}
    suspect, ref = _suspects_and_reference(links, rings, reference)
    gemm = gemm_probe(repeats=10, group=control, slowdown=emulation.compute_factor, device=device)
    return monitor.report_validation(suspect, gemm, link_reference_s=ref, pause_s=time.perf_counter() - t0)


def _time_rings(rings: list[list[int]], comms: list, emulation: Any, control: Any, device: Any) -> dict:
    return validate_rings(rings, nbytes=VALIDATION_BYTES, group=control, device=device, comms=comms,
                          send_delay_s=lambda src, dst: emulation.send_delay_s(src, dst, VALIDATION_BYTES))


def _suspects_and_reference(links: dict, rings: list, reference: list) -> tuple[dict, float | None]:
    """The flagged rings' links, and the reference ring's median link time (None without one)."""
    ref_times = [t for (a, b), t in links.items() if reference and {a, b} <= set(reference[0])]
    suspect = {k: t for k, t in links.items() if any(set(k) <= set(r) for r in rings)}
    return suspect, float(np.median(ref_times)) if ref_times else None


def rings_to_validate(grid: list[list[int]], suspicious: list) -> list[list[int]]:
    """Profiling-narrowed validation (Falcon §4.3): the rings of the suspicious groups only —
    ``pp{d}_link{i}`` → pipeline d, ``dp_stage{s}`` → the DP column of stage s — or, when profiling
    flagged none, every pipeline and DP column. Falcon's tree validation (4 passes,
    :func:`~titan_ext.runtime.falcon.validation.validate_trees`) is not used here: the job's
    collectives are gloo rings, and a 2-replica DP group's tree is its single link, which the ring
    passes already time in both directions."""
    pipelines = [list(row) for row in grid]
    columns = [[row[s] for row in grid] for s in range(len(grid[0]))]
    rings = []
    for g in suspicious:
        name = str(g)
        if name.startswith("pp") and "_link" in name:
            ring = pipelines[int(name[2:name.index("_link")])]
        elif name.startswith("dp_stage"):
            ring = columns[int(name[len("dp_stage"):])]
        else:
            continue
        if ring not in rings:
            rings.append(ring)
    return rings or pipelines + columns
