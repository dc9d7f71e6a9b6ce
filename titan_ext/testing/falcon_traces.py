"""Labelled synthetic iteration-time traces (steps, ramps, jitter, spikes) for the detector.

Used by ``tests/falcon/test_falcon_detect.py`` and ``scripts/bench_falcon.py``. Each trace is generated from
a fixed seed, so a set of traces is reproducible. Categories (Falcon §3 characterises fail-slows as
persistent slowdowns lasting tens of seconds to hours; jitter and isolated spikes are not fail-slows):

* ``jitter``: multiplicative Gaussian noise around a constant level (negative).
* ``spikes``: jitter plus isolated 1–2-iteration spikes of 1.5–4×, ≥ 3 iterations apart (negative).
* ``step``: jitter plus a step of 1.2–3× at ``onset`` lasting ≥ 30 iterations, optionally followed by
  recovery at ``relief`` (positive).
* ``ramp``: jitter plus a linear ramp over 5–30 iterations from ``onset`` to 1.3–2.5×, then a plateau
  (positive).
* ``step_spikes``: a step with spikes before and after it (positive).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["LabelledTrace", "make_trace", "make_traces", "CATEGORIES"]

CATEGORIES = ("jitter", "spikes", "step", "ramp", "step_spikes")


@dataclass(frozen=True)
class LabelledTrace:
    times_s: np.ndarray
    category: str
    seed: int
    failslow: bool
    onset: int | None = None
    """First slow iteration (None for negatives)."""
    full_effect: int | None = None
    """First iteration at the full slowdown (== onset for steps, end of ramp for ramps)."""
    relief: int | None = None
    """First recovered iteration, if the trace recovers."""
    factor: float = 1.0


def make_trace(category: str, seed: int, length: int = 300) -> LabelledTrace:
    rng = np.random.default_rng(seed)
    base = rng.uniform(0.2, 2.0)
    sigma = rng.uniform(0.005, 0.04)
    level = np.ones(length)
    onset = full = relief = None
    factor = 1.0
    failslow = category in ("step", "ramp", "step_spikes")
    if category in ("step", "step_spikes"):
        onset = int(rng.integers(60, 150))
        factor = float(rng.uniform(1.2, 3.0))
        full = onset
        if rng.random() < 0.5:
            relief = int(rng.integers(onset + 30, length - 40))
        end = relief if relief is not None else length
        level[onset:end] = factor
    elif category == "ramp":
        onset = int(rng.integers(60, 150))
        factor = float(rng.uniform(1.3, 2.5))
        ramp_len = int(rng.integers(5, 31))
        full = onset + ramp_len
        level[onset:full] = 1.0 + (factor - 1.0) * (np.arange(1, ramp_len + 1) / ramp_len)
        level[full:] = factor
    elif category not in ("jitter", "spikes"):
        raise ValueError(f"unknown category {category!r}; expected one of {CATEGORIES}")
    times = base * level * (1.0 + sigma * rng.standard_normal(length))
    if category in ("spikes", "step_spikes"):
        # Isolated spikes: 1-2 consecutive iterations, at least 3 normal iterations between spikes.
        n_spikes = int(rng.integers(2, 8))
        # (and, in step_spikes, at least 4 iterations away from the onset / relief boundaries).
        grid = np.arange(5, length - 3, 5)
        for edge in (onset, relief):
            if edge is not None:
                grid = grid[(grid + 2 < edge - 3) | (grid > edge + 3)]
        starts = np.sort(rng.choice(grid, size=n_spikes, replace=False))
        for at in starts:
            width = int(rng.integers(1, 3))
            times[at : at + width] *= rng.uniform(1.5, 4.0)
    times = np.maximum(times, 1e-3 * base)
    return LabelledTrace(times, category, seed, failslow, onset, full, relief, factor)


def make_traces(n_per_category: int, seed0: int = 0, length: int = 300) -> list[LabelledTrace]:
    """``n_per_category`` traces of every category, seeds ``seed0, seed0 + 1, ...``."""
    out = []
    seed = seed0
    for cat in CATEGORIES:
        for _ in range(n_per_category):
            out.append(make_trace(cat, seed, length))
            seed += 1
    return out
