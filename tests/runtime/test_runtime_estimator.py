"""runtime/measure/estimator.py: window medians of the exchanged profiles (moved from test_runtime_parts.py)."""

from __future__ import annotations

import math

import pytest

from titan_ext.runtime.measure.estimator import Estimator
from titan_ext.runtime.measure.profiler import RankProfile

S, N = 4, 8


def _rank(f, i, w, b=math.nan):
    return RankProfile(0, 0, f, i, w, b, 0.0, 0.0, 0.0, 0.0, math.nan, math.nan, math.nan, 0.0, 0, [], [], [], [])


def test_estimator_takes_window_medians_and_keeps_old_rows_when_nothing_was_measured():
    est = Estimator(2, N, window=3, initial_times_ms=(7.0, 8.0, 9.0))
    assert est.profile().f_ms == (7.0, 7.0) and est.profile().delays_ms == (0.0,)
    for f, c in ((1.0, 10.0), (100.0, 12.0), (3.0, 11.0)):
        est.push([_rank(f, 2.0, 1.0), _rank(2 * f, 2.0, 1.0)], [c])
    prof = est.profile()
    assert prof.f_ms == (3.0, 6.0) and prof.delays_ms == (11.0,)
    # a full-backward iteration (I, W unmeasured) leaves the split window as it was
    est.push([_rank(3.0, math.nan, math.nan, 5.0), _rank(6.0, math.nan, math.nan, 5.0)], [11.0])
    assert est.profile().b_ms == (2.0, 2.0) and est.profile("full").b_ms == (5.0, 5.0)
    assert est.profile("full").w_ms == (0.0, 0.0)
    # the window holds 3 rows: the outlier 100 has left
    assert est.profile().f_ms == (3.0, 6.0)


def test_derived_profiles_follow_every_push():
    """Profiles are built once per state of the windows: after a push they are the new state's (here the
    per-action cost the planning profile adds to every compute action, and the medians)."""
    import dataclasses

    est = Estimator(2, N, window=3)
    est.push([dataclasses.replace(_rank(2.0, 2.0, 1.0), gap_ms=0.5)] * 2, [0.0])
    first = est.planning_profile()
    assert first is est.planning_profile()  # the same state: built once
    assert first.f_ms == (2.5, 2.5) and first.w_ms == (1.5, 1.5)
    est.push([dataclasses.replace(_rank(4.0, 2.0, 1.0), gap_ms=0.5)] * 2, [0.0])  # F medians (2, 4) -> 3
    est.push([dataclasses.replace(_rank(4.0, 2.0, 1.0), gap_ms=1.5)] * 2, [0.0])  # gap medians (.5, .5, 1.5)
    assert est.profile().f_ms == (4.0, 4.0) and est.planning_profile().f_ms == (4.5, 4.5)
    est.push([dataclasses.replace(_rank(4.0, 2.0, 1.0), gap_ms=1.5)] * 2, [0.0])  # gap window (.5, 1.5, 1.5)
    assert est.planning_profile().f_ms == (5.5, 5.5) and est.planning_profile("full").b_ms == (3.0 + 1.5,) * 2  # one action


def test_window_medians_follow_every_push_of_their_key():
    # against statistics computed here from the rows pushed: a median asked twice, then after a push of
    # another key (unchanged) and of its own key (changed, the oldest row leaving the window of 3)
    import random
    import statistics

    from titan_ext.runtime.measure.estimator import Window

    rng = random.Random(7)
    win, pushed = Window(3), {"F": [], "C": []}
    for _ in range(6):
        for key in ("F", "C"):
            row = [rng.uniform(1, 9) if rng.random() > 0.2 else math.nan for _ in range(4)]
            win.push(key, row)
            if any(not math.isnan(v) for v in row):
                pushed[key].append(row)
            for k in ("F", "C"):
                for _ in range(2):
                    want = []
                    for j in range(4):
                        vals = [r[j] for r in pushed[k][-3:] if not math.isnan(r[j])]
                        want.append(statistics.median(vals) if vals else math.nan)
                    got = win.median(k, 4)
                    assert [(math.isnan(a), a if not math.isnan(a) else 0) for a in got] == \
                        [(math.isnan(b), b if not math.isnan(b) else 0) for b in want]
                    got.append(0.0)  # the caller's copy: the window's own stays as it is
