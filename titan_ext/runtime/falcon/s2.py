"""What S2 (Falcon §5.3) measures and how it follows it, free of process groups.

:class:`ReplicaTimes` keeps, for the last iterations, each DP replica's measured time per chunk
(Eq. 1's t_i, "profiled by Falcon-Detect"), the split it ran with and the iteration time. Three
uses, one definition of "measured" (:meth:`ReplicaTimes.measured`):

* S2's plan: Eq. 1 on the current segment's medians;
* S2 as a closed loop (beyond the paper; docs/falcon.md "S2 as a closed loop"):
  :meth:`ReplicaTimes.refined_split`;
* S4 only where it pays (beyond the paper; docs/falcon.md "S4 applied"):
  :meth:`ReplicaTimes.predicted_after_exclusion`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from .mitigation import predicted_iteration_s

__all__ = ["ReplicaTimes"]


class ReplicaTimes:
    """The last ``window`` iterations' (index, iteration time, t_i per replica or None, split)."""

    def __init__(self, window: int):
        self._rows: deque = deque(maxlen=max(1, window))
        self.s2_applied = False
        self.tried: set[tuple[int, ...]] = set()
        """S2's splits since the last onset or relief (:meth:`refined_split` tries each once)."""

    def record(self, index: int, iteration_s: float, per_replica_s, split) -> None:
        self._rows.append((index, float(iteration_s), per_replica_s, None if split is None else list(split)))

    def measured(self, since: int, replicas: int, count: int = 1, split=None) -> tuple[list[float], float] | None:
        """Medians of the measured times per chunk of each of ``replicas`` replicas and of the
        iteration times, over the recorded iterations from ``since`` on (only those run with
        ``split``, when given); None unless at least ``count`` of them, each with every replica
        measured."""
        rows = [(it, t) for i, it, t, s in self._rows if i >= since and (split is None or s == split)]
        if len(rows) < count or any(t is None or len(t) != replicas or not all(x > 0 for x in t) for _, t in rows):
            return None
        return [float(np.median(col)) for col in zip(*(t for _, t in rows))], float(np.median([it for it, _ in rows]))

    def new_event(self) -> None:
        """An onset or relief: every split may be tried again."""
        self.tried = set()

    def planned(self, split: list[int]) -> list[int]:
        """S2 applied with ``split`` (Alg. 1's ladder or the closed loop)."""
        self.s2_applied = True
        self.tried.add(tuple(split))
        return split

    def refined_split(self, since: int, count: int, split: Sequence[int], gain: float,
                      plan: Callable[[list[float]], list[int]]) -> list[int] | None:
        """S2 as a closed loop (not in the paper, whose Eq. 1 is solved once): once S2 applied, the
        split ``plan`` (Eq. 1) gives for the times measured with ``split`` in force over ``count``
        iterations from ``since`` on, if it is predicted at least ``gain`` faster
        (:func:`~.mitigation.predicted_iteration_s`) and was not tried since the last onset or
        relief (no flapping); else None. Why: t_i measured at one split can mislead at another — on
        a shared host a replica given fewer chunks frees cores for the others — and a device that
        recovers leaves a skewed split behind, which the same rule returns to even."""
        measured = self.measured(since, len(split), count, split) if self.s2_applied else None
        if measured is None:
            return None
        t, now = measured
        new = plan(t)
        if tuple(new) in self.tried or predicted_iteration_s(now, split, t, new) > (1.0 - gain) * now:
            return None
        return new

    def predicted_after_exclusion(self, since: int, split: Sequence[int], kept_replicas, chunks_per_replica: int,
                                  planned_split=None) -> tuple[float, float] | None:
        """(S4's predicted iteration time, the one it is compared with), both
        :func:`~.mitigation.predicted_iteration_s` from the iterations from ``since`` on that ran
        ``split`` (their median time and times per chunk); the comparison is the current time, or
        the one predicted for ``planned_split`` (an S2 plan of this iteration) where lower. None
        without such measurements."""
        measured = self.measured(since, len(split), split=split)
        if measured is None:
            return None
        t, now = measured
        after = predicted_iteration_s(now, split, t, [chunks_per_replica if d in kept_replicas else 0
                                                      for d in range(len(split))])
        if planned_split is not None:
            now = min(now, predicted_iteration_s(now, split, t, planned_split))
        return after, now
