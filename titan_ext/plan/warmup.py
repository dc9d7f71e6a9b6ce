"""Warm-up planning: how many forwards each stage runs before its first backward (PipeMorph §4.1–4.2).

``x_i`` is stage i's warm-up forward count, ``Δ_i = x_i − x_{i+1}`` the slackness of link i.
Theorem 1 / Eq.1: a one-way delay ``c_i`` on link i is absorbed without cascading bubbles iff
``t^F_i + t^B_i + 2 c_i ≤ Δ_i (t^F_{i+1} + t^B_{i+1})``.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..args import bool_arg, counts_arg, int_arg, real_arg
from .profile import link_arg, profile_arg
from .profile import PipelineProfile


def slackness(warmup_counts: Sequence[int]) -> list[int]:
    """Δ_i = x_i − x_{i+1} for every link i. Warm-up counts of any valid plan are >= 1 and non-increasing
    along the stages (stage i runs every forward stage i+1 ran before its first backward, before its
    own first backward): others raise ValueError, never a negative slackness."""
    warmup_counts = counts_arg(warmup_counts, "warmup_counts", minimum=1)
    if not warmup_counts:
        raise ValueError("warmup_counts is empty: one count per stage (S >= 1)")
    for i in range(len(warmup_counts) - 1):
        if warmup_counts[i] < warmup_counts[i + 1]:
            raise ValueError(f"warmup_counts must be non-increasing along the stages (x_i >= x_{{i+1}}), got "
                             f"x_{i} = {warmup_counts[i]} < x_{i + 1} = {warmup_counts[i + 1]}")
    return [warmup_counts[i] - warmup_counts[i + 1] for i in range(len(warmup_counts) - 1)]


def plan_slackness(warmup_counts: Sequence[int]) -> list[int] | None:
    """:func:`slackness` of a deployed plan's ``warmup_counts`` for its reports, None where they do not
    decrease along the stages: a plan with several stages per rank carries the per-stage targets its
    order was generated from (``plan.virtual``'s search over a memory budget may pick [8, 7, 8, …]),
    which are not warm-up counts in §4.1's sense and have no slackness.  A report never fails a deploy
    (the swap's log line and the iteration metrics read this, not :func:`slackness`)."""
    counts = list(warmup_counts)
    if any(a < b for a, b in zip(counts, counts[1:])):
        return None
    return slackness(counts)


def initial_warmup_counts(num_stages: int, max_inflight: int) -> list[int]:
    """PipeMorph Alg.1 (initial planning): maximise min_i Δ_i with stage 0 holding ``max_inflight``.

    ``max_inflight`` is x_max = ⌊M / M^F⌋ (Alg.1 line 2). The remaining ``x_max − 1`` forwards are spread
    as evenly as possible over the ``S − 1`` links, the first ``r`` links getting one more (lines 4–9).
    """
    int_arg(num_stages, "num_stages")
    int_arg(max_inflight, "max_inflight")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if max_inflight < 1:
        raise ValueError(f"max_inflight must be >= 1 (memory for at least one microbatch), got {max_inflight}")
    if num_stages == 1:
        return [max_inflight]
    delta_avg, r = divmod(max_inflight - 1, num_stages - 1)
    counts = [max_inflight]
    for i in range(1, num_stages):
        delta = delta_avg + 1 if i <= r else delta_avg
        counts.append(counts[-1] - delta)
    return counts


def initial_warmup_counts_for(profile: PipelineProfile, memory_limit: int | None = None) -> list[int]:
    """Alg.1 for a profile: x_max from the stage-0 memory budget (or ``memory_limit`` activations, or N
    when neither is given), then capped per stage by that stage's own budget and by N.

    Per-stage caps are our extension for heterogeneous budgets (Alg.1 assumes one M and M^F): each
    x_i is clipped to the stage's ``max_inflight`` and kept non-increasing (Lemma 1).
    """
    profile_arg(profile)
    real_arg(memory_limit, "memory_limit", minimum=1, optional=True)
    N = profile.num_microbatches
    caps = list(profile.max_inflight() or [N] * profile.num_stages)
    if memory_limit is not None:
        caps = [min(c, memory_limit) for c in caps]
    caps = [min(c, N) for c in caps]
    counts = initial_warmup_counts(profile.num_stages, caps[0])
    return _clip_monotone(counts, caps)


def adapted_warmup_counts(
    profile: PipelineProfile, slack_floor: int = 2, memory_limit: int | Sequence[int] | None = None, *,
    literal: bool = False
) -> list[int]:
    """PipeMorph Alg.2 (dynamic adaptation, §4.2) with Δ_i as the arXiv version (Adaptra, arXiv:2504.19232)
    writes it in its line 9: the ceiling, with stage i's own F and B, which is what Eq.1 asks. The NSDI
    version's line 7 has ⌊(t^F_i + t^B_{i+1} + 2c_i) / (t^F_{i+1} + t^B_{i+1})⌋, which can leave Eq.1
    violated (docs/planner.md).

    Backward from ``x_{S−1} = 1``: ``Δ_i = min(N − 2S, max(⌈(t^F_i + t^B_i + 2c_i) / (t^F_{i+1} + t^B_{i+1})⌉,
    floor))`` and ``x_i = x_{i+1} + Δ_i``. The published floor is 2 (headroom for jitter); ``slack_floor``
    may lower it to 1 to save memory. Where ``N − 2S`` is below the floor (few microbatches) the clip is
    the floor itself, and no x_i exceeds N (a stage cannot warm up with more forwards than exist).
    ``memory_limit`` (activations, one for every stage or one per stage), when given, caps every x_i (kept
    non-increasing).
    ``literal=True``: the clip exactly as published, min(N − 2S, ·) even below the floor, so at N = 2S
    every Δ_i is 0 and x_i = 1 everywhere (x_i ≥ 1 kept; a candidate of ``plan_pipemorph``).
    """
    profile_arg(profile)
    int_arg(slack_floor, "slack_floor")
    bool_arg(literal, "literal")
    if isinstance(memory_limit, Sequence):  # one per stage
        counts_arg(memory_limit, "memory_limit", profile.num_stages, minimum=1)
    else:
        real_arg(memory_limit, "memory_limit", minimum=1, optional=True)

    if slack_floor < 1:
        raise ValueError(f"slack_floor must be >= 1, got {slack_floor}")
    S, N = profile.num_stages, profile.num_microbatches
    clip = N - 2 * S if literal else max(N - 2 * S, slack_floor)
    counts = [0] * S
    counts[S - 1] = 1
    for i in range(S - 2, -1, -1):
        need = required_slackness(profile, i)
        delta = min(clip, max(need, slack_floor))
        counts[i] = max(1, min(counts[i + 1] + delta, N))
    if memory_limit is not None:
        limits = list(memory_limit) if isinstance(memory_limit, Sequence) else [memory_limit] * S
        if len(limits) != S or any(k < 1 for k in limits):
            raise ValueError(f"memory_limit must be >= 1 activation (or one such per stage), got {memory_limit}")
        counts = _clip_monotone(counts, limits)
    return counts


def required_slackness(profile: PipelineProfile, link: int, delay_ms: float | None = None) -> int:
    """Smallest Δ_link satisfying Eq.1 for the link's delay (or ``delay_ms``)."""
    link = link_arg(profile_arg(profile), link)
    real_arg(delay_ms, "delay_ms", minimum=0, optional=True)
    c = profile.delays_ms[link] if delay_ms is None else delay_ms
    num = profile.f_ms[link] + profile.b_ms[link] + 2.0 * c
    den = profile.f_ms[link + 1] + profile.b_ms[link + 1]
    # Guard the ceiling against float noise (e.g. 2.0000000000000004 → 3).
    return max(1, math.ceil(num / den - 1e-9))


def link_tolerance_ms(profile: PipelineProfile, warmup_counts: Sequence[int], link: int) -> float:
    """Largest one-way delay on ``link`` that the plan absorbs (Eq.1 solved for c_i):
    :func:`link_tolerances_ms` of that one link."""
    link = link_arg(profile_arg(profile), link)
    return link_tolerances_ms(profile, warmup_counts)[link]


def link_tolerances_ms(profile: PipelineProfile, warmup_counts: Sequence[int]) -> list[float]:
    """Per link, the largest one-way delay the plan absorbs (Eq.1 solved for c_i): with Δ_i = x_i − x_{i+1},
    (Δ_i (t^F_{i+1} + t^B_{i+1}) − t^F_i − t^B_i) / 2 (the counts checked once for all links: the runtime's
    policy reads every link at each check).

    Infinite when stage i runs all N forwards in its warm-up (x_i ≥ N, GPipe's shape): Theorem 1
    (PipeMorph §4.1) bounds the delay by the feasible interval of the *steady* phase, between a backward
    and the next forward of stage i; with no forward left after the first backward there is no steady
    phase, the delay is paid once in the fill and drain (every plan pays that), never per micro-batch,
    and no slackness could do better."""
    profile_arg(profile)
    x = counts_arg(warmup_counts, "warmup_counts", profile.num_stages, minimum=1)
    f, b, N = profile.f_ms, profile.b_ms, profile.num_microbatches
    return [math.inf if x[i] >= N else ((x[i] - x[i + 1]) * (f[i + 1] + b[i + 1]) - f[i] - b[i]) / 2.0
            for i in range(profile.num_stages - 1)]


def absorbs_delay(
    profile: PipelineProfile, warmup_counts: Sequence[int], link: int, delay_ms: float | None = None
) -> bool:
    """Eq.1 tolerance check: does the plan with ``warmup_counts`` absorb this measured delay on ``link``?

    ``delay_ms`` defaults to the profile's own delay of that link. The run-time detector calls this.
    """
    link = link_arg(profile_arg(profile), link)
    real_arg(delay_ms, "delay_ms", minimum=0, optional=True)
    c = profile.delays_ms[link] if delay_ms is None else delay_ms
    return c <= link_tolerance_ms(profile, warmup_counts, link) + 1e-9


def zb_warmup_counts(num_stages: int, num_microbatches: int) -> list[int]:
    """Warm-up of the ZeroBubble pipeline of PipeMorph Fig.4: x_i = 2(S − i) − 1 (Δ_i = 2), capped at N.

    This is the plan whose published timings are 390 ms (no delay) and 400 / 440 ms with 10 / 20 ms on
    link 0 (S=4, N=12, t=10 ms): stage 0 runs F_1..F_7 before B_1 (§3.1). It is also what Alg.2 yields
    with no delay (Δ at its floor of 2).
    """
    int_arg(num_stages, "num_stages", 1)
    int_arg(num_microbatches, "num_microbatches", 1)
    return [min(2 * (num_stages - i) - 1, num_microbatches) for i in range(num_stages)]


def zb_h1_warmup_counts(num_stages: int) -> list[int]:
    """Minimal warm-up, 1F1B's memory (ZB-H1): x_i = S − i (Δ_i = 1, so any delay cascades)."""
    int_arg(num_stages, "num_stages", 1)
    return [num_stages - i for i in range(num_stages)]


def one_f_one_b_warmup_counts(num_stages: int, num_microbatches: int) -> list[int]:
    """torch's Schedule1F1B warm-up: x_i = S − i forwards (:func:`zb_h1_warmup_counts`), at most N — the
    counts of the one 1F1B order, ``pipemorph.one_f_one_b_order``."""
    int_arg(num_microbatches, "num_microbatches", 1)
    return [min(x, num_microbatches) for x in zb_h1_warmup_counts(num_stages)]


def _clip_monotone(counts: Sequence[int], caps: Sequence[int]) -> list[int]:
    out: list[int] = []
    for i, (x, cap) in enumerate(zip(counts, caps)):
        x = max(1, min(x, cap))
        if out:
            x = min(x, out[-1])
        out.append(x)
    return out
