"""The profile estimate every rank plans from: windows of exchanged measurements → window medians
(PipeMorph §6 "profiler": robust statistics over the last checks).

Every rank pushes the *same* gathered rows (the control plane's all_gather), so every rank holds the
same estimate and reaches the same decision and plan.  Pure: no process group.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Callable, Sequence

from titan_ext.plan import LinkProfile, PipelineProfile
from titan_ext.plan.ir import COMPUTE_KINDS

from ..execute.memory import RELEASE
from .profiler import RankProfile

__all__ = ["Estimator", "Window"]


class Window:
    """Per-iteration estimates of the last ``size`` checks that measured them (medians over them = the
    robust estimate).  Keys: F, I, W, B (per stage), C (per link) and G (per rank: the time per action
    that was neither compute nor an input wait, ``IterationProfile.gap_ms``).  A row with no measurement at all
    (e.g. I and W while a full-backward plan runs) is not pushed, so the last measurements are kept."""

    KEYS = COMPUTE_KINDS + ("C", "G")

    def __init__(self, size: int):
        self.size = size
        self.rows: dict[str, deque] = {k: deque(maxlen=size) for k in self.KEYS}
        #: rows pushed so far: what is derived from the windows is the same until it changes
        self.pushes = 0
        self._medians: dict[tuple[str, int], list[float]] = {}  # (key, n) → medians, until the key's next push

    def push(self, key: str, row: Sequence[float]) -> None:
        if any(not math.isnan(v) for v in row):
            self.rows[key].append(list(row))
            self.pushes += 1
            for cached in [k for k in self._medians if k[0] == key]:
                del self._medians[cached]

    def median(self, key: str, n: int) -> list[float]:
        """Per entry ``j < n``, the median of the window's measured (non-NaN) values, NaN where none; computed
        once per state of the key's window (a check's decision, metrics and cadence ask for the same ones)."""
        if (key, n) not in self._medians:
            out = []
            for j in range(n):
                vals = [row[j] for row in self.rows[key] if not math.isnan(row[j])]
                out.append(statistics.median(vals) if vals else math.nan)
            self._medians[key, n] = out
        return list(self._medians[key, n])


class Estimator:
    """Windows of the exchanged per-stage times and per-link delays → a plan-layer profile."""

    def __init__(self, num_stages: int, n_microbatches: int, window: int,
                 initial_times_ms: tuple[float, float, float] = (1.0, 1.0, 1.0)):
        self.num_stages, self.n_microbatches = num_stages, n_microbatches
        self.window = Window(window)
        self.initial_times_ms = tuple(float(t) for t in initial_times_ms)
        self._profiles: dict = {}  # derived profiles of the windows' current state (_memo)

    def push(self, ranks: Sequence[RankProfile], link_delays_ms: Sequence[float]) -> None:
        """One check's gathered profiles (by rank) and per-link delay estimates."""
        for key, row in (("F", [r.f_ms for r in ranks]), ("I", [r.i_ms for r in ranks]),
                         ("W", [r.w_ms for r in ranks]), ("B", [r.b_ms for r in ranks]),
                         ("C", list(link_delays_ms)), ("G", [r.gap_ms for r in ranks])):
            self.window.push(key, row)

    def stage_rank(self) -> Sequence[int]:
        """The rank of each stage (the per-action cost is measured per rank): one stage per rank here."""
        return range(self.num_stages)

    def action_cost_ms(self) -> list[float]:
        """Per stage, the robust time per action of its rank outside compute and input waits
        (``IterationProfile.gap_ms``; 0 before any data)."""
        ranks = list(self.stage_rank())
        gaps = self.window.median("G", max(ranks) + 1)
        return [0.0 if math.isnan(gaps[r]) else gaps[r] for r in ranks]

    def planning_profile(self, backward: str = "split") -> PipelineProfile:
        """The profile plans are made, compared and judged with: :meth:`profile` with every compute action
        of a stage longer by its rank's measured per-action cost (``PipelineProfile.with_action_cost``).

        The executor's time between two actions that is neither compute nor an input wait (posting sends
        and receives, the timer: 0.2–0.5 ms an action on a busy 2-core CPU host, tens of microseconds of
        launch gaps on a GPU) is spent on every action; a model without it predicts a makespan the
        runtime cannot reach (13–20 % under on the CPU benchmark), times the extra action of a split
        backward as free and puts Eq. 1's tolerances where the pipeline does not run.  The compute-only
        :meth:`profile` stays what the metrics report as compute times."""
        return self._memo(("planning", backward), lambda: self.profile(backward).with_action_cost(
            self.action_cost_ms(), full_backward=backward == "full"))

    @property
    def version(self) -> int:
        """Changes whenever the windows do: what is derived from them alone is the same until it does."""
        return self.window.pushes

    def _memo(self, key: tuple, build: Callable[[], PipelineProfile]) -> PipelineProfile:
        """A profile derived from the windows alone, built once per state of the windows (profiles are
        immutable): a check's decision and its metrics ask for the same ones."""
        cache = self._profiles
        if cache.get("version") != self.version:
            cache.clear()
            cache["version"] = self.version
        if key not in cache:
            cache[key] = build()
        return cache[key]

    def profile(self, backward: str = "split") -> PipelineProfile:
        """The robust estimate as a plan-layer profile; ``initial_times_ms`` before any data.

        ``backward="full"``: the profile a full-backward plan is planned and checked with — measured
        full-B times as ``b_ms`` and ``w_ms`` = 0 (I + W of the split measurements until B is measured).
        """
        return self._memo(("profile", backward), lambda: self._profile(backward))

    def _profile(self, backward: str) -> PipelineProfile:
        S, N, win = self.num_stages, self.n_microbatches, self.window
        f0, i0, w0 = self.initial_times_ms

        def pick(v: float, default: float, floor: float) -> float:
            return max(v, floor) if not math.isnan(v) else default

        f = [pick(v, f0, 1e-3) for v in win.median("F", S)]
        i = [pick(v, i0, 1e-3) for v in win.median("I", S)]
        w = [pick(v, w0, 0.0) for v in win.median("W", S)]
        c = [pick(v, 0.0, 0.0) for v in win.median("C", S - 1)]
        links = tuple(LinkProfile(latency_ms=x) for x in c)
        profile = PipelineProfile(S, N, tuple(f), tuple(i), tuple(w), links, release=RELEASE)
        if backward == "full":
            b = [pick(v, fallback, 1e-3) for v, fallback in zip(win.median("B", S), profile.fused().b_ms)]
            profile = PipelineProfile(S, N, tuple(f), tuple(b), (0.0,) * S, links, release=RELEASE)
        return profile
