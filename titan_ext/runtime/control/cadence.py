"""When the ranks exchange profiles and the policy runs: the check cadence ("adaptive k", ours; PipeMorph §6
"Straggler mitigation": the profiler tracks continuously).

A check happens every ``period`` iterations.  The period starts at ``profile_every`` and doubles after
2 × ``window`` quiet checks (keep or hold, nothing planning, no probe, no link delay moved beyond the
policy's margins since the previous check: the window refreshed twice without news), up to
``profile_every_max``; anything else resets it to ``profile_every``.  The price is detection latency:
a new straggler is seen at the next check, at most ``profile_every_max`` iterations later.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

__all__ = ["CheckCadence"]


class CheckCadence:
    """The iteration of the next check, from how quiet the previous checks were."""

    def __init__(self, profile_every: int, profile_every_max: int, window: int, rel_margin: float,
                 abs_margin_ms: float):
        self.profile_every = profile_every
        self.adaptive(profile_every_max)
        self.window, self.rel_margin, self.abs_margin_ms = window, rel_margin, abs_margin_ms
        self.period, self._quiet, self._next = profile_every, 0, 0
        self._last_delays: list[float] = []

    @classmethod
    def of(cls, config: Any, window: int, every_iteration: bool) -> "CheckCadence":
        """The cadence of a schedule's config (``AdaptiveConfig``), fixed when an observer needs every iteration."""
        s = config.policy_settings
        cadence = cls(config.profile_every, config.profile_every_max, window, s.rel_margin, s.abs_margin_ms)
        if every_iteration:
            cadence.fixed()
        return cadence

    def adaptive(self, profile_every_max: int) -> None:
        """Let the period grow to ``profile_every_max`` (never below ``profile_every``) while checks are quiet."""
        self.profile_every_max = max(self.profile_every, profile_every_max)

    def fixed(self) -> None:
        """Check at every ``profile_every`` iterations, never less often (an observer needs them all)."""
        self.profile_every_max = self.profile_every

    def due(self, iteration: int) -> bool:
        return iteration >= self._next

    def links_moved(self, delays: Sequence[float]) -> bool:
        """Whether a link's window estimate (the median the policy decides on) differs from the previous
        check's by more than the margins (10 % + 1 ms by default).  The caller passes the window's medians,
        not one check's readings: their noise is positive-only and can exceed the margin every check on a
        busy host (receives posted late, a slow transport's thread hops: 1–4.5 ms readings on idle links
        under the ``nccl_rules`` test backend), which would keep the period at 1 for good."""
        previous, self._last_delays = self._last_delays, list(delays)
        return len(previous) != len(delays) or any(
            not (math.isfinite(a) and math.isfinite(b)) or abs(a - b) > self.rel_margin * max(a, b) + self.abs_margin_ms
            for a, b in zip(previous, delays))

    def after_check(self, iteration: int, settled: bool, delays: Sequence[float]) -> None:
        """Schedule the next check; ``settled``: the decision was keep/hold with nothing in flight."""
        moved = self.links_moved(delays)  # always: the next check compares with this one's delays
        quiet = settled and not moved
        self._quiet = self._quiet + 1 if quiet else 0
        if not quiet:
            self.period = self.profile_every
        elif self._quiet >= 2 * self.window:
            self.period, self._quiet = min(2 * self.period, self.profile_every_max), 0
        self._next = iteration + self.period
