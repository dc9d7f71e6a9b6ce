"""FalconMonitor: the once-per-iteration entry point for the schedule / trainer (Falcon §4–§5).

Process-group free, with explicit inputs and outputs: ``observe`` takes an
:class:`~.decision.IterationObservation` (iteration time, per-group times, the replicas' measured
micro-batch times and their split) and returns a :class:`~.decision.FalconDecision` (frozen: the
``falcon/...`` metrics the trainer merges into its per-iteration metrics and W&B, with typed
accessors); ``report_validation`` takes validation's timings and returns one too. Nothing is set on
the monitor between calls. Its parts are the modules they already are: detector (:mod:`.bocd`),
localiser (:mod:`.localize`), planner (:mod:`.mitigation`, S2's times in :mod:`.s2`). Applying a
decision (re-plan, re-weight, validate, restart) is the caller's job; see docs/falcon.md.

Workflow per fail-slow event:
  tracking (BOCD + verification, §4.2) → onset → profiling (suspicious groups, §4.3) →
  ``falcon/validate = 1`` → the trainer runs ``validation.validate_rings`` / ``gemm_probe`` and calls
  :meth:`FalconMonitor.report_validation` → root cause → Alg. 1 planner (§5.2) each slow iteration →
  ``falcon/apply = "<strategy>"`` with its concrete plan → measured effect ``falcon/effect/<strategy>``
  → relief closes the event.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from titan_ext.args import ArgumentTypeError, bool_arg, instance_arg, int_arg, real_arg

from .attribution import attribute, link_cause
from .bocd import BOCDConfig, SlowIterationDetector
from .decision import FalconDecision, IterationObservation
from .localize import locate_slow_devices, locate_slow_links, suspicious_groups
from .mitigation import MitigationPlanner, StrategyCosts, grid_arg, min_max_microbatch_split, plan_topology
from .period import estimate_period
from .s2 import ReplicaTimes

__all__ = ["FalconConfig", "FalconMonitor", "FalconDecision", "IterationObservation"]


@dataclass
class FalconConfig:
    detector: BOCDConfig = field(default_factory=BOCDConfig)
    """Detection parameters (threshold 0.9, 10 % verification)."""
    costs: StrategyCosts = field(default_factory=StrategyCosts)
    """Overhead of every mitigation strategy, seconds (ski-rental switch points)."""
    suspicious_ratio: float = 1.1
    """Profiling: group transfer time > ratio × median is suspicious (Falcon §4.3)."""
    slow_link_ratio: float = 1.5
    """Validation: a ring link slower than ratio × median of validated links is slow."""
    slow_link_min_excess_s: float = 0.002
    """Validation: ... and slower by more than this (noise floor of a P2P timing)."""
    slow_device_ratio: float = 1.1
    """Validation: a GEMM probe slower than ratio × median marks a slow device."""
    effect_window: int = 5
    """Iterations before / after an applied strategy whose median times give its measured effect."""
    validation_wait_iters: int = 2
    """If no validation is reported this many iterations after onset, classify from profiling only."""
    delegation_available: bool = False
    """PipeMorph CPU delegation can accompany a re-plan (PipeMorph §5)."""
    num_microbatches: int | None = None
    """Global micro-batches M for the redistribution plan (Falcon Eq. 1)."""
    period_threshold: float = 0.95
    """ACF threshold M for call-record periods (Falcon §4.2)."""
    period_window: int = 2048
    """Calls over which the period is (re-)estimated (max lag = half of it)."""
    group_tracking: bool = True
    """Also track every profiled group's time with BOCD (:meth:`FalconMonitor._track_groups`): a
    group's slowdown proposes its change-point to the iteration-time verification, which a fault
    on one group passes several iterations before the iteration series' own posterior reaches 0.9.
    False: Falcon §4.2's iteration-time tracking alone."""
    group_floor_s: float = 1e-3
    """Group times below this are tracked as this (a healthy PP link's measured delay is ~0)."""
    split_refine_gain: float | None = 0.1
    """S2 as a closed loop (:meth:`FalconMonitor._refine_split`): once S2 applied, a split that
    Eq. 1 on the times measured with the split in force predicts this fraction faster replaces it.
    None: S2 plans once, as in the paper."""

    def __post_init__(self) -> None:
        """Every field checked at construction: TypeError naming it for a wrong type,
        ValueError for a value out of range -- before any monitor, hook or process group exists."""
        instance_arg(self.detector, "FalconConfig.detector", BOCDConfig)
        instance_arg(self.costs, "FalconConfig.costs", StrategyCosts)
        for name in ("suspicious_ratio", "slow_link_ratio", "slow_device_ratio"):
            # below 1 would flag the median itself as slow
            real_arg(getattr(self, name), f"FalconConfig.{name}", minimum=1.0)
        real_arg(self.slow_link_min_excess_s, "FalconConfig.slow_link_min_excess_s", minimum=0)
        int_arg(self.effect_window, "FalconConfig.effect_window", 1)
        int_arg(self.validation_wait_iters, "FalconConfig.validation_wait_iters", 0)
        bool_arg(self.delegation_available, "FalconConfig.delegation_available")
        int_arg(self.num_microbatches, "FalconConfig.num_microbatches", 1, optional=True)
        real_arg(self.period_threshold, "FalconConfig.period_threshold", positive=True, maximum=1.0)
        int_arg(self.period_window, "FalconConfig.period_window", 2)  # a period must repeat once in it
        bool_arg(self.group_tracking, "FalconConfig.group_tracking")
        real_arg(self.group_floor_s, "FalconConfig.group_floor_s", positive=True)
        gain = real_arg(self.split_refine_gain, "FalconConfig.split_refine_gain", optional=True)
        if gain is not None and not 0.0 < gain < 1.0:
            raise ValueError(f"FalconConfig.split_refine_gain must be in (0, 1) or None, got {self.split_refine_gain!r}")


def _group_names(groups, name: str) -> dict:
    """The group names of ``pp_groups`` / ``dp_groups`` (text, as ``per_group_times`` names them): a
    mapping name -> PP link (its values checked by the caller) or an iterable of names, not one text."""
    if isinstance(groups, (str, bytes)) or not (isinstance(groups, Mapping) or hasattr(groups, "__iter__")):
        raise ArgumentTypeError(f"{name} must be a mapping group name -> PP link or an iterable of group names, "
                                f"got {groups!r}")
    names = list(groups.keys() if isinstance(groups, Mapping) else groups)
    for g in names:
        if not isinstance(g, str):
            raise ArgumentTypeError(f"{name}: group names are text (as per_group_times names them), got {g!r}")
    return dict(groups) if isinstance(groups, Mapping) else dict.fromkeys(names)


def _recorder_arg(recorder):
    """None or a call record (:class:`~.hooks.CallRecorder`: anything with ``records``)."""
    if recorder is not None and not hasattr(recorder, "records"):
        raise ArgumentTypeError(f"recorder must be a CallRecorder (with .records) or None, got {recorder!r}")
    return recorder


class FalconMonitor:
    """``observe(IterationObservation) -> FalconDecision`` once per iteration
    (``observe(t, per_group_times)`` is short for ``observe(IterationObservation(t, per_group_times))``).

    ``grid[dp][pp]`` (global ranks) lets validation results be classified (a slow link on a PP hop vs
    inside a DP group) and topology plans be made; ``pp_groups`` / ``dp_groups`` name the groups of
    ``per_group_times`` by kind (``pp_groups`` may be a dict ``name -> PP link index`` so a re-plan
    decision can name the link). ``recorder`` (a :class:`~.hooks.CallRecorder`) lets
    ``observe(None)`` derive iteration times from communication calls alone.
    """

    def __init__(self, config: FalconConfig | None = None, grid=None, pp_groups=(), dp_groups=(),
                 recorder=None):
        # every argument checked first: TypeError / ValueError naming it
        self.config = FalconConfig() if config is None else instance_arg(config, "config", FalconConfig)
        self.grid = grid_arg(grid) if grid is not None else None
        pp, dp = _group_names(pp_groups, "pp_groups"), _group_names(dp_groups, "dp_groups")
        self.pp_link_of = ({g: int_arg(i, f"pp_groups[{g!r}]", 0) for g, i in pp.items()}
                           if isinstance(pp_groups, Mapping) else {})
        self.pp_groups, self.dp_groups = set(pp), set(dp)
        both = sorted(self.pp_groups & self.dp_groups)
        if both:
            raise ValueError(f"pp_groups and dp_groups both name {both}: a group is one kind")
        _recorder_arg(recorder)
        self.slow_link_excess_s: dict[tuple[int, int], float] = {}
        self._group_excess_s: dict = {}
        self.recorder = recorder
        self.detector = SlowIterationDetector(self.config.detector)
        self.planner = MitigationPlanner(self.config.costs)
        self.iteration = -1
        self.recent = deque(maxlen=max(1, self.config.effect_window))
        self._pending_effects: list[tuple[str, int, float]] = []  # (strategy, applied_at, before)
        self._awaiting_validation_since: int | None = None
        self.suspicious: list = []
        self.slow_links: list[tuple[int, int]] = []
        self.slow_devices: list[int] = []
        self.device_slowdown: dict[int, float] = {}  # GEMM probe time / median, per rank
        self.root_cause: str | None = None
        self.attribution: list[dict] = []
        """The last localisation's components, each with its cause (:mod:`.attribution`)."""
        self._handled: set[tuple[int, ...]] = set()  # components a strategy was decided for, this event
        self._moved_links: set[tuple[int, ...]] = set()
        """Links S3 was decided for (any event): handled in a later event too while the grid keeps them
        on a pipeline hop (:meth:`_handled_across_events`)."""
        self._root_key: tuple[int, ...] | None = None
        self.root_component: str | None = None
        """The component the root cause was taken from (e.g. ``device 3``, ``link 0-1``)."""
        self.history: list[dict] = []
        self._period: int | None = None
        self._calls_consumed = 0
        self._group_detectors: dict[str, SlowIterationDetector] = {}
        self._measured_split: list[int] | None = None  # the last observation's split
        self.s2 = ReplicaTimes(self.config.effect_window)  # the last effect_window iterations' t_i
        self._changed_at = -1  # iteration of the last applied strategy
        self._group_proposals: dict[str, tuple] = {}  # group -> (its change-point, since iteration)

    @property
    def measured_split(self) -> list[int] | None:
        """The split of the last observation that carried the replicas' times (None: none did)."""
        return None if self._measured_split is None else list(self._measured_split)

    @property
    def root_key(self) -> tuple[int, ...] | None:
        """The root component's key (a link's two ranks, sorted, or a device's rank; None: none)."""
        return self._root_key

    @property
    def period_calls(self) -> int:
        """The call record's current ACF period in calls (0: none found yet)."""
        return self._period or 0

    def set_grid(self, grid) -> None:
        """The layout after a topology change (S3): ``grid[dp][pp]`` = global rank."""
        self.grid = grid_arg(grid)

    def attach_recorder(self, recorder) -> None:
        """Derive iteration times from this :class:`~.hooks.CallRecorder` (``observe(None)``, ACF)."""
        self.recorder = _recorder_arg(recorder)

    # ---------------------------------------------------------------- tracking
    def iteration_times_from_recorder(self) -> list[float]:
        """New iteration times from the call record (ACF period, Falcon §4.2).

        The period is estimated (first lag with ACF >= 0.95) over the unconsumed records once enough
        calls exist; each further period gives one iteration time (time between a call and its
        occurrence one period earlier). If the call at the next anchor no longer matches its
        signature one period earlier (the call pattern changed, e.g. a new schedule), the period is
        re-estimated from there.
        """
        recs = self.recorder.records
        total = getattr(self.recorder, "total_recorded", len(recs))
        offset = total - len(recs)  # absolute index of recs[0]
        if self._calls_consumed < offset:
            self._calls_consumed = offset
            self._period = None
        out = []
        while True:
            if self._period is None:
                hi = min(total, self._calls_consumed + self.config.period_window)
                window = [recs[i - offset].signature for i in range(self._calls_consumed, hi)]
                self._period = estimate_period(window, self.config.period_threshold)
                if self._period is None:
                    return out
            p = self._period
            while self._calls_consumed + 2 * p <= total:
                i = self._calls_consumed - offset
                if recs[i + p].signature != recs[i].signature:
                    self._calls_consumed += 1  # pattern changed here: resynchronise, re-estimate
                    self._period = None
                    break
                out.append(recs[i + p].t_start - recs[i].t_start)
                self._calls_consumed += p
            if self._period is not None:
                return out

    def observe(self, observation: IterationObservation | float | None = None,
                per_group_times: dict | None = None) -> FalconDecision:
        """Feed one iteration; returns its decision (the ``falcon/*`` metrics). ``observation`` may be
        the iteration time alone (with ``per_group_times``), or None with a call recorder."""
        if not isinstance(observation, IterationObservation):
            observation = IterationObservation(observation, per_group_times or {})
        elif per_group_times is not None:
            raise TypeError("observe(IterationObservation) takes its group times from the observation")
        obs = observation
        groups = dict(obs.per_group_times) if obs.per_group_times else None
        if obs.iteration_time_s is None:
            if self.recorder is None:
                raise ValueError("observe(None) needs a CallRecorder (FalconMonitor(recorder=...) or "
                                 "attach_recorder): an observation without iteration_time_s")
            times = self.iteration_times_from_recorder()
            if not times:
                return FalconDecision(self.iteration, {"falcon/state": "slow" if self.detector.slow else "healthy"})
            for t in times[:-1]:
                self._observe_one(t, None, None)
            return self._observe_one(times[-1], groups, obs)
        return self._observe_one(obs.iteration_time_s, groups, obs)

    def _observe_one(self, t: float, per_group_times: dict | None,
                     obs: IterationObservation | None) -> FalconDecision:
        c = self.config
        t0 = time.perf_counter()
        self.iteration += 1
        it = self.iteration
        replica_s = list(obs.replica_microbatch_s) if obs is not None and obs.split is not None else None
        if replica_s is not None:
            self._measured_split = list(obs.split)
        cp = self.detector.observe(t)
        # a fault from the start: DP peers compared — unless a validation already named the slow devices
        if cp is None and self.config.detector.peer_ratio > 0 and not self.slow_devices:
            cp = self.detector.compare_replicas(replica_s, self._measured_split)
        out: dict = {"falcon/iteration_time_s": t}
        if cp is not None and cp.by != "time":
            out["falcon/change_point_by"], out["falcon/slow_replica"] = cp.by, cp.replica
        self.s2.record(len(self.detector.times) - 1, t, replica_s, self._measured_split)
        self._track_groups(per_group_times)
        if cp is None:
            cp = self._verify_group_proposals(out)
        if cp is not None:
            out["falcon/event"] = cp.kind
            out["falcon/change_point_iteration"] = cp.index
            out["falcon/change_point_latency_iters"] = cp.detected_at - cp.index
            out["falcon/change_point_relative_change"] = cp.relative_change
            if cp.kind in ("onset", "relief"):
                self.s2.new_event()
                self._handled = self._handled_across_events()  # a new event: its components are new
            if cp.kind == "onset" or (cp.kind == "level" and cp.relative_change > 0 and self.planner.active):
                self._on_onset(per_group_times, out)
            elif cp.kind == "relief":
                self.planner.stop()
                self._awaiting_validation_since = None
                out["falcon/event_slow_iters"] = self.planner.slow_iters
                out["falcon/event_impact_s"] = self.planner.impact_s
        if self.detector.slow:
            if self._awaiting_validation_since is not None and (
                it - self._awaiting_validation_since >= c.validation_wait_iters
            ):
                self._classify(out)  # no validation arrived: profiling-only root cause
            if self.planner.active:
                for s in self.planner.step(t):
                    self._apply(s, out)
        if "falcon/apply" not in out:
            self._refine_split(out)
        if self.detector.slow and self.planner.active:
            out["falcon/slow_iters"] = self.planner.slow_iters
            out["falcon/impact_s"] = self.planner.impact_s
            nxt = self.planner.next_strategy
            out["falcon/next_strategy"] = nxt or ""
            out["falcon/next_overhead_s"] = c.costs.of(nxt) if nxt else float("nan")
        self._measure_effects(t, out)
        self.recent.append(t)
        out["falcon/state"] = "slow" if self.detector.slow else "healthy"
        out["falcon/cp_probability"] = self.detector.last_probability
        out["falcon/detector_us"] = (time.perf_counter() - t0) * 1e6
        if len(out) > 4 and any(k in out for k in ("falcon/event", "falcon/apply", "falcon/validate")):
            self.history.append({"iteration": it, **out})
        return FalconDecision(it, out)

    # ---------------------------------------------------------------- group tracking
    def _track_groups(self, per_group_times: dict | None) -> None:
        """Every profiled group's time through its own detector (BOCD + verification on the
        group's series); a verified slowdown of a group (``onset`` / ``level`` upwards) becomes a
        proposal that :meth:`_verify_group_proposals` checks against the iteration times.

        Why (measured in docs/falcon.md "Group tracking"): Falcon §4.2 detects on the
        iteration time alone; with ±20 % step noise and 3 healthy steps before a fault, a +40 %
        step was confirmed between its 3rd and its 22nd slow step (1 of 8 recorded series: never),
        while the faulty group's own time (5x) is at its 3rd. The verification stays Falcon's."""
        if not self.config.group_tracking:
            return
        times = per_group_times or {}
        for g in [g for g in self._group_detectors if g not in times]:
            del self._group_detectors[g]  # a group that stopped reporting restarts when it returns
            self._group_proposals.pop(g, None)
        for g, v in times.items():
            if g not in self._group_detectors:
                self._group_detectors[g] = self._group_detector()
            det = self._group_detectors[g]
            gcp = det.observe(max(float(v), self.config.group_floor_s))
            if gcp is not None and gcp.kind in ("onset", "level") and gcp.relative_change > 0:
                self._group_proposals[g] = (gcp, self.iteration)

    def _group_detector(self) -> SlowIterationDetector:
        """The iteration detector's parameters, its run lengths truncated at twice its window: a
        group's change-point only matters while it is recent, and this bounds the per-group cost."""
        d = self.config.detector
        return SlowIterationDetector(dataclasses.replace(d, max_run_length=min(d.max_run_length, 2 * d.window),
                                                         start_relative_change=0.0))  # noisy: full baseline

    def _verify_group_proposals(self, out: dict):
        """The iteration-time verification of the groups' proposed change-points, the largest
        excess first; a proposal is retried each iteration while its group stays at the new level
        (no later change-point of the group) for at most ``max_pending`` iterations."""
        ranked = []
        for g, (gcp, since) in list(self._group_proposals.items()):
            det = self._group_detectors[g]
            if det.change_points[-1] is not gcp or self.iteration - since > self.config.detector.max_pending:
                del self._group_proposals[g]
                continue
            excess = float(np.median(det.times[gcp.index:])) - gcp.level_before
            tau = gcp.index + len(self.detector.times) - len(det.times)  # its iteration index
            ranked.append((excess, g, tau, gcp.probability))
        for excess, g, tau, p in sorted(ranked, reverse=True):
            cp = self.detector.verify_proposed(tau, p, excess)
            if cp is not None:
                self._group_proposals.clear()
                out["falcon/change_point_group"] = g
                return cp
        return None

    # ---------------------------------------------------------------- localisation
    def _suspicious(self, times: dict) -> list:
        """Profiling (§4.3): groups whose transfer time exceeds ``suspicious_ratio`` × the median *of
        their kind*, slowest first. A DP group's time is a collective's transfer time and a PP
        group's is a link's measured delay (≈ 0 when healthy), so one median over both flagged every
        DP group whenever the PP delays were near zero; DP groups, PP groups and unnamed groups are
        each held to their own median."""
        kinds = ({g: t for g, t in times.items() if g in self.dp_groups},
                 {g: t for g, t in times.items() if g in self.pp_groups},
                 {g: t for g, t in times.items() if g not in self.dp_groups | self.pp_groups})
        hits = [g for kind in kinds for g in suspicious_groups(kind, self.config.suspicious_ratio)]
        return sorted(hits, key=lambda g: -times[g])

    def _on_onset(self, per_group_times, out):
        """Profiling, then ask for validation (§4.3): on an onset, and on a further slowdown during an
        event (a ``level`` event slower than before) — a second fault while the first is mitigated,
        as in Falcon's compound case study (§7.3, Fig. 17: slow communication → S3, then a slow GPU
        → S2, then S4), is localised anew and its root cause (the component not handled yet,
        :mod:`.attribution`) restarts Alg. 1's ladder (:meth:`_classify`)."""
        self.suspicious = self._suspicious(per_group_times or {})
        self.slow_links, self.slow_devices, self.root_cause = [], [], None
        self.slow_link_excess_s = {}
        med = float(np.median(list(per_group_times.values()))) if per_group_times else 0.0
        self._group_excess_s = {g: per_group_times[g] - med for g in self.suspicious}
        out["falcon/suspicious_groups"] = ",".join(str(g) for g in self.suspicious)
        out["falcon/validate"] = 1
        self._awaiting_validation_since = self.iteration

    def report_validation(self, link_times_s: dict | None = None, gemm_times_s: dict | None = None,
                          link_reference_s: float | None = None, pause_s: float | None = None) -> FalconDecision:
        """Results of ``validate_rings`` / ``gemm_probe`` → slow links / devices → root cause.

        ``pause_s``: how long training was suspended for validation (reported as a metric)."""
        c = self.config
        real_arg(pause_s, "pause_s", minimum=0, optional=True)
        slow_links = self.slow_links_in(link_times_s or {}, link_reference_s)  # checks the timings first
        slow_devices = locate_slow_devices(gemm_times_s or {}, c.slow_device_ratio)
        if link_times_s:
            ref = (float(np.median(list(link_times_s.values()))) if link_reference_s is None
                   else float(link_reference_s))
            self.slow_link_excess_s = {k: v - ref for k, v in link_times_s.items()}
        self.slow_links, self.slow_devices = slow_links, slow_devices
        ref = float(np.median(list(gemm_times_s.values()))) if gemm_times_s else 1.0
        self.device_slowdown = {k: v / ref for k, v in (gemm_times_s or {}).items()}
        out: dict = {
            "falcon/slow_links": ";".join(f"{a}->{b}" for a, b in self.slow_links),
            "falcon/slow_devices": ",".join(str(d) for d in self.slow_devices),
        }
        if pause_s is not None:
            out["falcon/validation_pause_s"] = float(pause_s)
        self._classify(out)
        self.history.append({"iteration": self.iteration, **out})
        return FalconDecision(self.iteration, out)

    def slow_links_in(self, link_times_s: dict, link_reference_s: float | None = None) -> list:
        """The links validation calls slow (§4.3): this monitor's thresholds on
        :func:`~.localize.locate_slow_links`."""
        c = self.config
        return locate_slow_links(link_times_s, c.slow_link_ratio, link_reference_s, c.slow_link_min_excess_s)

    def _classify(self, out):
        """The root cause (§4.3) from validation's components (:func:`~.attribution.attribute`: a
        slow link not touching a slow device is the link's; the first component this event has not
        handled gives the cause), else from profiling's slowest group; then Alg. 1 (re)starts."""
        att = attribute(self.slow_links if self.grid is not None else [],  # no grid: a link has no kind
                        self.slow_devices, self.grid, self._handled, self.slow_link_excess_s,
                        self.device_slowdown)
        self.attribution = [c.as_row() for c in att.components]
        self._root_key = att.root.key if att.root is not None else None
        self.root_component = att.root.label() if att.root is not None else None
        cause = att.root_cause or "unknown"
        if att.root is None and self.suspicious:
            g = self.suspicious[0]
            cause = "pp_link" if g in self.pp_groups else "dp_link" if g in self.dp_groups else "unknown"
        self.root_cause = cause
        if self.attribution:
            out["falcon/attribution"] = json.dumps(self.attribution)
        self._awaiting_validation_since = None
        out["falcon/root_cause"] = cause
        if not self.detector.slow:
            return  # the event already ended (relief before the validation arrived)
        healthy = self.detector.healthy_mean_s or float(np.mean(self.recent))
        # Slow iterations since the event's onset, except the current one (step() adds it): a root
        # cause found by re-localisation restarts the ladder with the impact accumulated so far
        # (the slowdown persisted; what it cost is rent already paid, §5.2).
        onset = next((c for c in reversed(self.detector.change_points) if c.kind == "onset"), None)
        upto = len(self.detector.times) - (1 if "falcon/iteration_time_s" in out else 0)
        so_far = self.detector.times[onset.index : upto] if onset is not None else []
        self.planner.start(cause, healthy, so_far)
        out["falcon/strategies"] = ",".join(self.planner.candidates)

    # ---------------------------------------------------------------- mitigation
    def plan_microbatch_split(self, per_group_microbatch_s) -> list[int]:
        m = self.config.num_microbatches
        if m is None:
            raise ValueError("FalconConfig.num_microbatches is needed for a redistribution plan")
        return min_max_microbatch_split(m, per_group_microbatch_s)

    def modelled_replica_slowdowns(self) -> list[float]:
        """Per ``grid`` row, its modelled micro-batch slowdown (∝ its slowest device): the measured
        iteration slowdown is that of the replica holding the slowest flagged device; a replica
        whose flagged device is less slow (on a shared host a second probe may cross the 1.1×
        threshold) gets a share of it in proportion to its own GEMM excess, replicas with no
        flagged device stay at 1 (:meth:`_replica_slowdown`)."""
        factor = self.detector.current_mean_s / (self.detector.healthy_mean_s or 1.0)
        return [self._replica_slowdown(row, factor) for row in self.grid]

    def predicted_after_exclusion(self, kept_replicas, chunks_per_replica: int,
                                  planned_split=None) -> tuple[float, float] | None:
        """S4's predicted iteration time and the one it is compared with
        (:meth:`~.s2.ReplicaTimes.predicted_after_exclusion` over the current segment at the last
        measured split); None without measurements."""
        if self._measured_split is None:
            return None
        return self.s2.predicted_after_exclusion(self._segment_start(), self._measured_split, kept_replicas,
                                                 chunks_per_replica, planned_split)

    def _segment_start(self) -> int:
        """First iteration of the current segment: the last change-point's, else 0."""
        return self.detector.change_points[-1].index if self.detector.change_points else 0

    def _refine_split(self, out: dict) -> None:
        """S2's closed loop (:meth:`~.s2.ReplicaTimes.refined_split`): over a full
        ``effect_window`` since the last change-point or applied strategy."""
        c = self.config
        split = self._measured_split
        if c.split_refine_gain is None or split is None or self.grid is None \
                or c.num_microbatches is None or len(split) != len(self.grid):
            return
        new = self.s2.refined_split(max(self._changed_at + 1, self._segment_start()), c.effect_window,
                                    split, c.split_refine_gain, self.plan_microbatch_split)
        if new is not None:
            out["falcon/split_refined_from"] = json.dumps(list(split))
            self._apply("microbatch_redistribution", out, split=new)

    def _replica_slowdown(self, row, factor: float) -> float:
        # flagged devices are > slow_device_ratio (≥ 1) × the median, so every excess is > 0
        slow = [self.device_slowdown[d] - 1.0 for d in row if d in self.slow_devices]
        if not slow:
            return 1.0
        worst = max(self.device_slowdown[d] for d in self.slow_devices) - 1.0
        return 1.0 + (factor - 1.0) * max(slow) / worst

    def _handled_across_events(self) -> set[tuple[int, ...]]:
        """The components a new event starts with as handled: the links an earlier S3 moved onto a
        pipeline hop, where the grid still has them (Falcon §7.3, Fig. 17: after S3 for the slow link
        and the event's end, a GPU that slows is the new root cause, S2, although validation still
        finds the link slow). A link S3 left where it was (its plan kept the grid) starts unhandled."""
        if self.grid is None:
            return set()
        return {k for k in self._moved_links if link_cause(k, self.grid) == "pp_link"}

    def _apply(self, strategy: str, out: dict, split: list[int] | None = None) -> None:
        """Record ``strategy`` applied this iteration, with its plan; ``split``: S2's refinement's."""
        prev = out.get("falcon/apply")
        out["falcon/apply"] = strategy if not prev else f"{prev},{strategy}"
        self._changed_at = self.iteration
        if strategy != "ignore" and self._root_key is not None:
            self._handled.add(self._root_key)  # a strategy of its ladder is decided for it
            if strategy == "topology_adjustment" and len(self._root_key) == 2:
                self._moved_links.add(self._root_key)
        if split is not None:
            out["falcon/plan/microbatch_split"] = json.dumps(self.s2.planned(list(split)))
        elif strategy == "microbatch_redistribution" and self.grid is not None and self.slow_devices:
            # Eq. 1's t_i: the replicas' measured micro-batch times where the trainer reports them,
            # else modelled from the iteration slowdown and the GEMM probe
            measured = self.s2.measured(self._segment_start(), len(self.grid))
            per_dp = measured[0] if measured else self.modelled_replica_slowdowns()
            if self.config.num_microbatches is not None:
                out["falcon/plan/microbatch_split"] = json.dumps(self.s2.planned(self.plan_microbatch_split(per_dp)))
        if strategy == "pipemorph_replan":
            link, excess = self._slow_pp_link()
            if link is not None:
                out["falcon/plan/pp_link"] = link
                out["falcon/plan/link_excess_ms"] = 1e3 * excess
            # PipeMorph §5/§6: CPU delegation accompanies the re-plan where it is available.
            out["falcon/plan/delegation"] = int(self.config.delegation_available)
        if strategy == "topology_adjustment" and self.grid is not None:
            plan = plan_topology(self.grid, self.slow_links, self.slow_devices)
            out["falcon/plan/topology_grid"] = json.dumps([list(r) for r in plan.grid])
            out["falcon/plan/topology_moved"] = plan.moved
        # "before": slow iterations of the current segment (since the last change-point), at most
        # effect_window of them, including this one; "after": the effect_window iterations that follow.
        # Medians, so one preempted iteration on a shared host does not decide the measured effect.
        times = self.detector.times
        lo = max(self._segment_start(), len(times) - self.config.effect_window)
        before = float(np.median(times[lo:])) if times[lo:] else float("nan")
        self._pending_effects.append((strategy, self.iteration, before))

    def _slow_pp_link(self) -> tuple[int | None, float]:
        """PP link index (joins stage i and i+1) of the slow link, and its measured excess time
        (validation message, or profiling group time, above the median)."""
        if self.slow_links and self.grid is not None:
            pos = {r: (d, s) for d, row in enumerate(self.grid) for s, r in enumerate(row)}
            a, b = self.slow_links[0]
            (da, sa), (db, sb) = pos[a], pos[b]
            if da == db and abs(sa - sb) == 1:
                return min(sa, sb), self.slow_link_excess_s.get((a, b), float("nan"))
        for g in self.suspicious:
            if g in self.pp_link_of:
                return int(self.pp_link_of[g]), self._group_excess_s.get(g, float("nan"))
        return None, float("nan")

    def _measure_effects(self, t: float, out: dict) -> None:
        w = self.config.effect_window
        keep = []
        for strategy, at, before in self._pending_effects:
            if self.iteration - at >= w:
                after = float(np.median(self.detector.times[at + 1 : at + w + 1]))
                out[f"falcon/effect/{strategy}"] = 1.0 - after / before
                out[f"falcon/effect/{strategy}/before_s"] = before
                out[f"falcon/effect/{strategy}/after_s"] = after
            else:
                keep.append((strategy, at, before))
        self._pending_effects = keep
