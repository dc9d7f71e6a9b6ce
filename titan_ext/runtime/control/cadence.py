"""When the ranks exchange profiles and the policy runs: the check cadence ("adaptive k", ours; PipeMorph §6
"Straggler mitigation": the profiler tracks continuously).

A check happens every ``period`` iterations.  The period starts at ``profile_every`` and doubles after
``window`` quiet checks (keep or hold, no plan swapped in, nothing planning, no probe, no link delay moved
beyond the policy's margins since the previous check: the window then holds only checks made under the
deployed plan, none with news), up to ``profile_every_max``; anything else resets it to
``profile_every``.  A check decided where it exchanges holds every rank at the boundary until the last
one arrives, so the period grows as soon as the window has nothing new to say (the refine and the
backward probe, which need checks under their plan, are not quiet and keep it short).  The price is
detection latency: a new straggler is seen at the next check, at most ``profile_every_max`` iterations later.

While the period is backed off (:attr:`CheckCadence.backed_off`) a check runs behind the training: its
exchange is posted at the boundary it is due (gloo's own all-gather: ``ControlPlane.start_all_gather``'s
``ring``) and decided on at the next one (``adaptive.py``), so the
training thread never waits for the exchange's hops; the price is one more iteration of detection latency,
paid only after quiet checks.  A check that is not quiet resets the period, and the next ones are
decided at the boundary they exchange at again.
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
        self._posted: tuple[Any, int] | None = None  # (exchange in flight, its iteration): a check running behind

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

    def exchanges_at(self, iteration: int) -> bool:
        """The boundary of ``iteration`` starts an exchange: a check is due and none posted at the previous
        boundary waits to be decided there."""
        return self._posted is None and self.due(iteration)

    def posts_receives_at(self, iteration: int) -> bool:
        """The boundary of ``iteration`` exchanges and decides at once: its receives are posted at the start of
        the iteration (``ControlPlane.expect``).  A check that runs behind gathers with gloo's own all-gather
        (``ring``), which posts its own."""
        return self.exchanges_at(iteration) and not self.backed_off

    @property
    def backed_off(self) -> bool:
        """The period has grown: the checks so far were quiet (a check may then run behind)."""
        return self.period > self.profile_every

    def post(self, exchange: Any, iteration: int, planning: bool) -> tuple[Any, int] | None:
        """A due check's exchange (started, in flight): (exchange, iteration) to decide on now, or None: it
        runs behind (backed off, no plan to agree on) and :meth:`take_posted` hands it over at the next boundary."""
        if self.backed_off and not planning:
            self._posted, self._next = (exchange, iteration), iteration + 2  # decided at iteration + 1, the next after
            return None
        return exchange, iteration

    def take_posted(self) -> tuple[Any, int] | None:
        """The check posted at the previous boundary, to decide on now (None: none)."""
        posted, self._posted = self._posted, None
        return posted

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

    def after_check(self, iteration: int, settled: bool, delays: Sequence[float], decided_at: int | None = None) -> None:
        """Schedule the next check; ``iteration``: the one whose profiles were exchanged; ``settled``: the
        decision was keep/hold, no plan swapped in, nothing in flight; ``decided_at``: the boundary the
        decision was taken at (a check that ran behind: the next one), the next check comes after it."""
        moved = self.links_moved(delays)  # always: the next check compares with this one's delays
        quiet = settled and not moved
        self._quiet = self._quiet + 1 if quiet else 0
        if not quiet:
            self.period = self.profile_every
        elif self._quiet >= self.window:
            self.period, self._quiet = min(2 * self.period, self.profile_every_max), 0
        self._next = max(iteration + self.period, (iteration if decided_at is None else decided_at) + 1)
