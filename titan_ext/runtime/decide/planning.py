"""Planners and background planning.

A :class:`Planner` turns the agreed profile estimate and the policy's decision into a compute-only plan,
a :class:`~titan_ext.plan.PlanResult` (the one result type of every planner, ``plan/result.py``).  The schedule is planner-agnostic:
``PipeMorph`` runs :class:`PipeMorphPlanner` (PipeMorph Alg.1/2 + Alg.3/4, §4.2), ``CrossPipe`` runs
:class:`CrossPipePlanner` (CrossPipe §4.2 greedy); any object with the same ``plan`` method plugs in
(``PipeMorph(..., planner=...)``).  Plans the policy names explicitly (a whole plan, or warm-up counts)
never reach the planner: :func:`explicit_plan` makes them, the same way for every planner.

:class:`BackgroundPlanning` runs plan → validate → lower in a thread while the next iteration runs; the
result is agreed on in the next profile exchange and swapped after it (PipeMorph §6, Fig.13 ⑤).
:class:`BackgroundPolish` runs the anytime polish of a deployed plan (``polish_s``: CP-SAT + CrossPipe's
search, ``titan_ext.plan.polish``) in a thread that the training thread never waits for: a rank offers the
polished plan's hash only once its thread is done.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from titan_ext.plan import LinkProfile, PipelineProfile, PlanResult, generate_order
from titan_ext.plan.pipemorph import SCHEDULES as PIPEMORPH_SCHEDULES
from titan_ext.plan.result import make_result
from titan_ext.plan.schedules import plan_by_name

from ..control.deploy import Candidate
from ..measure.profiler import now
from .policy import Decision

__all__ = ["BackgroundPlanning", "BackgroundPolish", "CrossPipePlanner", "PipeMorphPlanner", "Planner",
           "PlanningContext", "explicit_plan"]


@dataclass(frozen=True)
class PlanningContext:
    """What a planner may use besides the profile and the decision (identical on every rank)."""

    backward: str  # split | full: the backward variant the plan must have
    x_max: int | list[int]  # Alg.1's memory bound of the initial plan (stage 0's x_max; per stage once known)
    adaptive_limit: int | list[int] | None  # cap on in-flight activations of adaptive plans (per stage; None: none)
    slack_floor: int  # Alg.2's minimum slackness
    headroom: Callable[[float], float]  # measured link delay → the delay a plan must absorb (with_headroom)
    rank_memory_limit: tuple[float, ...] | None = None  # several stages per rank: K_r per rank (memory.py)


class Planner(Protocol):
    """``plan(profile, decision, context)`` → a :class:`PlanResult` (``titan_ext.plan.result.make_result``
    wraps any compute-only plan); ``backward_choices`` → the values of ``backward=`` it can honour."""

    backward_choices: tuple[str, ...]

    def plan(self, profile: PipelineProfile, decision: Decision, context: PlanningContext) -> PlanResult: ...


def explicit_plan(profile: PipelineProfile, decision: Decision, backward: str) -> PlanResult | None:
    """The plan a decision names itself (its actions, or its warm-up counts via Alg.3/4 under its in-flight
    limit, by default the counts), else None."""
    if decision.actions is not None:
        return make_result(decision.actions, schedule="explicit", predicted_makespan_ms=math.nan, plan_ms=0.0)
    if decision.warmup_counts is None:
        return None
    x = list(decision.warmup_counts)
    limit = list(decision.inflight_limit) if decision.inflight_limit is not None else x
    t0 = time.perf_counter()
    order = generate_order(profile, x, inflight_limit=limit, full_backward=backward == "full")
    return make_result(order.order, schedule="explicit", warmup_counts=x, inflight_limit=limit,
                       predicted_makespan_ms=order.makespan_ms, plan_ms=(time.perf_counter() - t0) * 1e3)


def with_headroom(profile: PipelineProfile, context: PlanningContext) -> PipelineProfile:
    """The profile a planner plans with: every measured link delay with the policy's head-room
    (``PolicySettings.headroom_delay``), whatever the mode — the initial plan recalibrated on measured
    times included.  The runtime's policy holds a plan to the delays it was planned for (``note_deployed``):
    a plan made for the bare medians would be "violated" by the next reading above them, on an idle link
    whose readings are host noise, and the planner would choose among candidates by a delay that is
    exceeded half the time."""
    return profile.with_delays({k: context.headroom(c) for k, c in enumerate(profile.delays_ms)})


#: a candidate plan that holds more activations than another within this much (relative) of the fastest
#: predicted makespan is not chosen (``plan_pipemorph(hold_margin=...)``): the plans are timed on measured
#: times that jitter by a few per cent between windows, and a deeper warm-up the model timed a fraction of a
#: per cent faster than 1F1B's own counts ran 2-4 % slower than Schedule1F1B at 16 ranks (docs/runtime.md)
HOLD_MARGIN = 0.01


class PipeMorphPlanner:
    """PipeMorph §4.2: Alg.1 (memory-bounded initial plan) / Alg.2 (absorb the measured delays), both
    generated by the event-driven Alg.3/4.  ``schedule``: a name of
    :func:`titan_ext.plan.schedules.plan_by_name` — "pipemorph", "zb", "zb-h1" or "auto" (the faster
    of PipeMorph and CrossPipe's greedy under the same simulator).  ``polish_s`` ("auto" only): the
    CrossPipe plan is polished within that many seconds per call (``titan_ext.plan.polish``; the
    background planner has a whole iteration to spend; None: off).  Of PipeMorph's candidates within
    ``HOLD_MARGIN`` of the fastest, the one holding the fewest activations is planned."""

    backward_choices = ("auto", "measure", "split", "full")

    def __init__(self, schedule: str = "pipemorph", polish_s: float | None = None):
        if schedule not in (*PIPEMORPH_SCHEDULES, "auto"):
            raise ValueError(f"PipeMorphPlanner schedule must be one of {', '.join(PIPEMORPH_SCHEDULES)}, auto; "
                             f"got {schedule!r}")
        if polish_s is not None and schedule != "auto":
            raise ValueError(f"polish_s needs schedule 'auto' (a CrossPipe plan to polish), got {schedule!r}")
        self.schedule = schedule
        self.polish = {} if polish_s is None else {"polish_s": polish_s}

    def plan(self, profile: PipelineProfile, decision: Decision, context: PlanningContext) -> PlanResult:
        # validate=False: the deploy path validates every plan, whatever planner made it (once)
        planning = with_headroom(profile, context)
        if decision.mode == "initial":
            return plan_by_name(planning, self.schedule, mode="initial", backward=context.backward,
                                slack_floor=context.slack_floor, memory_limit=context.x_max, validate=False,
                                hold_margin=HOLD_MARGIN, **self.polish)
        return plan_by_name(planning, self.schedule, mode="adaptive", backward=context.backward,
                            slack_floor=context.slack_floor, memory_limit=context.adaptive_limit,
                            validate=False, hold_margin=HOLD_MARGIN, **self.polish)


class CrossPipePlanner:
    """CrossPipe §4.2 greedy generator (one stage per rank) on the measured profile.

    The planner reads the description every planner of plan/ reads: the measured stage-level
    ``PipelineProfile`` (its links' α and size·β, its memory rule ``release``) on the one-stage-per-rank
    placement with a per-rank memory limit (``plan.placed.PlacedProfile``, built by ``plan_by_name`` →
    ``crosspipe.placed_from_profile``), in integer ns.  Each measured one-way delay c becomes a
    ``LinkProfile`` of latency α and bandwidth time size·β (CrossPipe §2.2, :meth:`alpha_beta`) when
    ``message_bytes`` and ``link_bandwidth_bytes_per_s`` are known, else all of it is latency.
    In-flight activations per rank are capped at the initial plan's x_max (re-plans: the adaptive cap
    when one is set), so CrossPipe never trades memory for speed behind the user's back (§4.2: M_L).
    ``polish_s``: each plan is polished within that many seconds (``titan_ext.plan.polish``; None: off)."""

    #: the greedy generator plans split backwards only (I and W are separate operations, CrossPipe §3.1)
    backward_choices = ("split",)

    def __init__(self, variant: str = "udsub", message_bytes: float | None = None,
                 link_bandwidth_bytes_per_s: float | Sequence[float] | None = None, polish_s: float | None = None):
        if variant not in ("ud", "udsub"):
            raise ValueError(f"CrossPipe run-time variant must be 'ud' or 'udsub' (one stage per rank), got {variant!r}")
        if message_bytes is not None and not message_bytes >= 0:
            raise ValueError(f"message_bytes must be >= 0, got {message_bytes}")
        self.variant = variant
        self.message_bytes = message_bytes
        self.link_bandwidth_bytes_per_s = link_bandwidth_bytes_per_s
        self.polish_s = polish_s

    def alpha_beta(self, profile: PipelineProfile) -> PipelineProfile:
        """Split each measured one-way delay c into latency α and size·β (CrossPipe §2.2): the profile's
        links as ``LinkProfile(latency_ms=c − size·β, bandwidth, message_bytes)``."""
        if self.message_bytes is None or self.link_bandwidth_bytes_per_s is None:
            return profile
        bw = self.link_bandwidth_bytes_per_s
        bws = [float(bw)] * len(profile.links) if isinstance(bw, (int, float)) else [float(x) for x in bw]
        if len(bws) != len(profile.links):
            raise ValueError(f"link_bandwidth_bytes_per_s has {len(bws)} entries, expected {len(profile.links)}")
        links = []
        for link, b in zip(profile.links, bws):
            transfer_ms = 0.0 if math.isinf(b) else self.message_bytes / b * 1e3
            links.append(LinkProfile(latency_ms=max(0.0, link.delay_ms - transfer_ms),
                                     bandwidth_bytes_per_s=b, message_bytes=self.message_bytes))
        return profile.with_links(links)

    def plan(self, profile: PipelineProfile, decision: Decision, context: PlanningContext) -> PlanResult:
        planning, limit = with_headroom(profile, context), context.x_max
        if decision.mode != "initial" and context.adaptive_limit is not None:
            limit = context.adaptive_limit
        return plan_by_name(self.alpha_beta(planning), f"crosspipe-{self.variant}", memory_limit=limit,
                            polish_s=self.polish_s)


class BackgroundPlanning:
    """One planning job at a time, in a daemon thread: ``job()`` returns a validated, lowered
    :class:`Candidate` (or raises).  ``join()`` waits for it; ``take()`` hands the outcome over."""

    def __init__(self) -> None:
        self._job: tuple[threading.Thread, dict, Decision] | None = None

    @property
    def running(self) -> bool:
        return self._job is not None

    def start(self, decision: Decision, job: Callable[[], Candidate], what: str) -> None:
        box: dict[str, Any] = {}

        def run() -> None:
            t0, c0 = now(), time.thread_time()
            try:
                box["candidate"] = job()
            except Exception as exc:  # noqa: BLE001 - a planner/validation failure never stops training
                box["error"] = f"{what}: planning/validation failed: {exc}"
            box["total_ms"] = 1e3 * (now() - t0)
            # CPU time of this thread: planning's real cost (its wall time also counts waiting for the
            # GIL while the training thread runs)
            box["cpu_ms"] = 1e3 * (time.thread_time() - c0)
            if "candidate" in box:
                box["candidate"].plan_cpu_ms = box["cpu_ms"]

        thread = threading.Thread(target=run, name="titan_ext-planner", daemon=True)
        self._job = (thread, box, decision)
        thread.start()

    def candidate_hash(self) -> int:
        """Hash of the job's plan (0: no job, or it failed); waits for the job."""
        if self._job is None:
            return 0
        thread, box, _ = self._job
        thread.join()
        cand = box.get("candidate")
        return cand.hash if cand is not None else 0

    def take(self) -> tuple[Candidate | None, Decision, str, float, float]:
        """(candidate or None, its decision, error, wall ms, CPU ms) of the finished job."""
        thread, box, decision = self._job  # type: ignore[misc]
        thread.join()
        self._job = None
        return (box.get("candidate"), decision, box.get("error", "planner produced nothing"),
                box.get("total_ms", 0.0), box.get("cpu_ms", math.nan))


class BackgroundPolish:
    """At most one pending polish, in a daemon thread: ``job()`` returns (a validated, lowered
    :class:`Candidate` or None, the polish's report).  Unlike :class:`BackgroundPlanning` nothing here
    waits for the thread: :meth:`ready_hash` is 0 until it is done, :meth:`take` is for a finished job
    only.  :meth:`discard` drops the pending job (its result would be stale); a thread still running
    ends on its own, and the next job's thread starts its work only after it (no pile-up of solvers)."""

    def __init__(self) -> None:
        self._job: tuple[threading.Thread, dict, str] | None = None
        self._last: threading.Thread | None = None  # the latest thread, pending or discarded

    @property
    def pending(self) -> bool:
        return self._job is not None

    @property
    def finished(self) -> bool:
        """A pending job whose thread is done (False: none, or still running)."""
        return self._job is not None and not self._job[0].is_alive()

    @property
    def what(self) -> str:
        return self._job[2] if self._job is not None else ""

    def start(self, job: Callable[[], tuple[Candidate | None, dict]], what: str) -> None:
        """Run ``job`` in the background (a pending job is discarded first)."""
        self.discard()
        box: dict[str, Any] = {}
        previous = self._last

        def run() -> None:
            if previous is not None:
                previous.join()  # a discarded polish still running: one solver at a time
            t0, c0 = now(), time.thread_time()
            try:
                box["candidate"], box["report"] = job()
            except Exception as exc:  # noqa: BLE001 - a failed polish never stops training
                box["error"] = f"{what}: polish/validation failed: {exc}"
            box["total_ms"] = 1e3 * (now() - t0)
            box["cpu_ms"] = 1e3 * (time.thread_time() - c0)
            if box.get("candidate") is not None:
                box["candidate"].plan_cpu_ms = box["cpu_ms"]

        thread = threading.Thread(target=run, name="titan_ext-polish", daemon=True)
        self._job, self._last = (thread, box, what), thread
        thread.start()

    def ready_hash(self) -> int:
        """Hash of the polished plan once the thread is done and made one; else 0.  Never waits."""
        if not self.finished:
            return 0
        cand = self._job[1].get("candidate")  # type: ignore[index]
        return cand.hash if cand is not None else 0

    def take(self) -> tuple[Candidate | None, dict, str, float, float]:
        """(candidate or None, report, error, wall ms, CPU ms) of the finished job; no job pending after."""
        if not self.finished:
            raise RuntimeError("BackgroundPolish.take: no finished polish")
        _, box, _ = self._job  # type: ignore[misc]
        self._job = None
        return (box.get("candidate"), box.get("report") or {}, box.get("error", ""),
                box.get("total_ms", 0.0), box.get("cpu_ms", math.nan))

    def discard(self) -> bool:
        """Drop the pending job (True if there was one)."""
        had, self._job = self._job is not None, None
        return had

    def join(self, timeout: float | None = None) -> None:
        """Wait for the latest thread (tests and shutdown only; the training thread never calls it)."""
        if self._last is not None:
            self._last.join(timeout)
