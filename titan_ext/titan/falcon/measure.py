"""What Falcon measures in the DP x PP job (Falcon §4.2-§4.3): the iteration time and per-group
times every step (the same numbers on every rank, so all take the same decision), the ACF iteration
time from the call record, and validation on onset.

Host data goes on gloo control groups; ring-validation buffers on the device.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from titan_ext.runtime.falcon.decision import FalconDecision, IterationObservation
from titan_ext.runtime.falcon.validation import gemm_probe, validate_rings
from titan_ext.runtime.timeouts import named

__all__ = ["SLOW_DEVICE_RATIO", "StepClock", "measure_step", "acf_iteration_times", "validate", "rings_to_validate"]

SLOW_DEVICE_RATIO = 1.5
"""GEMM probe: a device slower than 1.5 x the median is slow. Falcon's 1.1 is for dedicated GPUs; on
a time-shared CPU host the fastest of 10 probe repeats of a healthy rank still varies by more than
10 % (and the emulated slow devices here are >= 2x)."""
VALIDATION_BYTES = 1 << 22
"""Validation messages (4 MB): large enough that a link F x slower in bandwidth (``A-B:xF``) shows
more than the monitor's 2 ms minimum excess on loopback."""


class StepClock:
    """A training step's *device* time, the detector's input (Falcon §4.2 detects fail-slow in the
    iteration time; a slow GPU shows in the time the device took, not in the host's enqueueing).

    Timed by the device layer (:func:`titan_ext.runtime.device.device_layer`): on CUDA, kernels run
    asynchronously behind the host, so two events on the compute stream bracket the step and the
    span between them is read once the last one completed — a wait on that one event, the step's one
    metrics read (never a device ``synchronize``); a backlog the device carries into or through the
    step is in it, the host's run-ahead is not. On CPU the host clock is the device clock."""

    def __init__(self, device: Any):
        from titan_ext.runtime.device import device_layer

        self.timer = device_layer(device if device is not None else "cpu").timer()

    def start(self) -> None:
        self.timer.begin_iteration()

    def stop_s(self) -> float:
        """The step's device time (seconds), from :meth:`start` to now on the compute stream."""
        self.timer.end_iteration()
        self.timer.resolve(block=True)
        return self.timer.wall_ms / 1e3


def measure_step(step_s: float, *, dp: Any, schedule: Any, costs: Any, control: Any, num_pp: int,
                 num_dp: int, dp_index: int, split: list[int]) -> IterationObservation:
    """The step's observation, the same on every rank (MAX over the world on ``control``): the
    iteration time (§4.2: the slowest rank's step, device time from :class:`StepClock`), the
    per-group times (§4.3 profiling: every stage's DP transfer time from ``dp``, every replica's PP
    link delays as PipeMorph's ``schedule`` measured them) and each replica's time per micro-batch
    at ``split`` (§5.3's t_i, S2's Eq. 1 input: its slowest stage's compute phase over its chunks —
    the replicas run independently until the DP sync). ``costs`` takes the re-plan's measured cost
    (its only side effect)."""
    from titan_ext.titan.metrics import runtime_metrics

    S, D = num_pp, num_dp
    vec = torch.zeros(1 + S + D * (S - 1) + D, dtype=torch.float64)
    vec[0] = step_s
    vec[1:1 + S] = torch.tensor(dp.transfer_times(), dtype=torch.float64)
    vec[-D + dp_index] = dp.compute_s
    rt = runtime_metrics(schedule)
    costs.measure_replan(rt)  # only a Falcon decision's ski-rental input
    for i, ms in rt.get("link_delay_ms", {}).items():
        if int(i) < S - 1 and ms == ms:  # not NaN
            vec[1 + S + dp_index * (S - 1) + int(i)] = max(0.0, float(ms)) / 1e3
    named(control, "falcon/step",  # a timeout names the silent rank
          lambda: dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=control))
    groups = {f"dp_stage{s}": float(vec[1 + s]) for s in range(S)}
    groups |= {f"pp{d}_link{i}": float(vec[1 + S + d * (S - 1) + i]) for d in range(D) for i in range(S - 1)}
    return IterationObservation(float(vec[0]), groups,
                                replica_microbatch_s=tuple(float(vec[-D + d]) / split[d] for d in range(D)),
                                split=tuple(split))


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


def validate(monitor: Any, *, grid: list[list[int]], emulation: Any, control: Any, device: Any) -> FalconDecision:
    """Falcon §4.3 validation (training pauses until it returns): ring passes over the groups
    profiling flagged (:func:`rings_to_validate`, from ``monitor.suspicious``) and one unflagged ring
    as the healthy reference — timed a second time when a link looks slow, a link's time then the
    slower of its two — then the GEMM probe on every rank; the monitor's verdict on them."""
    t0 = time.perf_counter()
    rings = rings_to_validate(grid, monitor.suspicious)
    # one ring profiling did not flag is timed too: the healthy reference a flagged ring's links
    # are compared with (all links of a lone flagged ring are slow: their own median hides them)
    reference = [r for r in rings_to_validate(grid, []) if r not in rings][:1]
    timed = [r for r in rings + reference if len(r) > 1]
    links = _time_rings(timed, emulation, control, device)
    if monitor.slow_links_in(*_suspects_and_reference(links, rings, reference)):
        # a second round before a link is called slow: a slow link is slow in both, while a loaded
        # host's scheduling noise (seen: one direction of a healthy DP link flagged, then S3
        # applied in a healthy run) rarely repeats; every rank holds the same times, so all agree
        again = _time_rings(timed, emulation, control, device)
        links = {k: max(t, again.get(k, t)) for k, t in links.items()}
    suspect, ref = _suspects_and_reference(links, rings, reference)
    gemm = gemm_probe(repeats=10, group=control, slowdown=emulation.compute_factor, device=device)
    return monitor.report_validation(suspect, gemm, link_reference_s=ref, pause_s=time.perf_counter() - t0)


def _time_rings(rings: list[list[int]], emulation: Any, control: Any, device: Any) -> dict:
    return validate_rings(rings, nbytes=VALIDATION_BYTES, group=control, device=device,
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
