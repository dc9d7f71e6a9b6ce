"""Planning with several stages per rank (virtual stages), looped or V-shaped (issue 14; docs/multistage.md).

R ranks each hold V model chunks ("stages"), S = R·V in data-flow order. Placements:

* ``"loop"`` — rank r holds stages r, r+R, r+2R, … (torch's Interleaved1F1B / InterleavedZeroBubble);
* ``"v"`` — zig-zag: rank r holds r and 2R−1−r (and so on for larger V), torch's ZBV / DualPipeV.

Rank link ℓ joins PP ranks ℓ and ℓ+1 and carries both directions of every stage boundary that crosses
it (its two directions are the channels of ``timing.LinkQueues``); a boundary between two stages on
one rank is free, and so is the wrap-around boundary of a looped placement (rank R−1 → rank 0), as in
``simulate``'s rank-level model.

PipeMorph's warm-up adaptation generalised to virtual stages (docs/multistage.md derives it):
Eq.1 (PipeMorph §4.2) becomes, for the boundary s → s+1 carried by a link of one-way delay c,

    t^F_s + t^B_{s+1} + 2c ≤ Δ_s · P_{ρ(s+1)},     P_r = Σ_{u on rank r} (t^F_u + t^B_u),

with Δ_s = x_s − x_{s+1} the slackness between consecutive stages and P_r the steady-state period of
the downstream rank (one F and one B of each of its V chunks per microbatch). With V = 1 it is Eq.1.
For uniform times (a rank's t split into V chunks of t/V) it reads c ≤ (Δ_s − 1/V)·t: the analogue of
Theorem 1 — a sufficient condition here, not a tight one (docs/multistage.md). The schedule is then
generated event-driven over the stage graph (Alg.3/4 with several stages per rank: B(I) > F > W,
per-stage warm-up and in-flight cap x_s), and a portfolio keeps the fastest of that plan, torch's own
built-ins for the placement and (V-shape) CrossWave, all simulated by ``simulate`` and the winner
checked by ``validate_plan``.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from .ir import Op, as_ops, gc_paused, torch_schedules
from .pipemorph import GeneratedSchedule
from .result import PlanResult, make_result, rank_peak_memory
from .placement import PLACEMENTS, stage_profile, stage_to_rank
from .profile import PipelineProfile
from .timing import LinkQueues, to_ms, to_ns

VIRTUAL_SCHEDULES = ("pipemorph", "crosspipe-wave")
# torch's 2-chunk built-ins per placement (plan.builtin names), the portfolio's baselines
PLACEMENT_BUILTINS = {
    "loop": ("Interleaved1F1B", "InterleavedZeroBubble"),
    "v": ("ZBVZeroBubble", "DualPipeV"),
}


virtual_stage_to_rank = stage_to_rank  # stage → rank: plan.placement's one definition


def virtual_profile(
    profile: PipelineProfile,
    num_virtual_stages: int,
    placement: str,
    *,
    stage_times_ms: tuple[Sequence[float], Sequence[float], Sequence[float]] | None = None,
) -> tuple[PipelineProfile, tuple[int, ...]]:
    """The stage-level profile (R·V stages) of a rank-level ``profile`` (R ranks, R−1 rank links), and
    its stage → rank map (``plan.placement.stage_profile``: each of rank r's V stages takes 1/V of its
    times unless ``stage_times_ms = (f, b, w)`` gives one value per stage)."""
    R, V, N = profile.num_stages, num_virtual_stages, profile.num_microbatches
    s2r = stage_to_rank(R, V, placement)
    S = len(s2r)
    if N < S:
        raise ValueError(f"{N} microbatches < {S} stages ({R} ranks × {V}): need at least one per stage")
    if V == 1 and stage_times_ms is None:
        return profile, s2r
    # the virtual planner caps memory with ``memory_limit`` alone (as before issue 25): no byte budget
    plain = replace(profile, activation_bytes=None, memory_budget_bytes=None)
    return stage_profile(plain, s2r, stage_times_ms), s2r


# ----------------------------------------------------------------------------- warm-up rule
def rank_periods_ms(profile: PipelineProfile, stage_to_rank: Sequence[int], with_w: bool = False) -> list[float]:
    """P_r = Σ over rank r's stages of t^F + t^B (+ t^W with ``with_w``): the rank's steady-state time per
    microbatch, the right-hand side's unit of the virtual-stage Eq.1."""
    R = max(stage_to_rank) + 1
    out = [0.0] * R
    for s, r in enumerate(stage_to_rank):
        out[r] += profile.f_ms[s] + profile.b_ms[s] + (profile.w_ms[s] if with_w else 0.0)
    return out


def required_virtual_slackness(
    profile: PipelineProfile, stage_to_rank: Sequence[int], boundary: int, with_w: bool = False
) -> int:
    """Smallest Δ_s ≥ 1 with t^F_s + t^B_{s+1} + 2c_s ≤ Δ_s · P_{ρ(s+1)} (docs/multistage.md, Eq.1 for
    virtual stages; c_s = 0 on a same-rank boundary)."""
    s = boundary
    c = profile.links[s].delay_ms if stage_to_rank[s] != stage_to_rank[s + 1] else 0.0
    period = rank_periods_ms(profile, stage_to_rank, with_w)[stage_to_rank[s + 1]]
    need = (profile.f_ms[s] + profile.b_ms[s + 1] + 2.0 * c) / period
    return max(1, math.ceil(need - 1e-9))


def virtual_warmup_counts(
    profile: PipelineProfile, stage_to_rank: Sequence[int], *, slack_floor: int = 1, with_w: bool = False
) -> list[int]:
    """Per-stage warm-up counts: x_{S−1} = 1, x_s = min(N, x_{s+1} + max(Δ_s required, floor)).

    With no delay and floor 1 this is x_s = S − s, the per-stage peak of torch's InterleavedZeroBubble
    and ZBV (PipeMorph Alg.2's recursion over the stage graph)."""
    if slack_floor < 1:
        raise ValueError(f"slack_floor must be >= 1, got {slack_floor}")
    S, N = profile.num_stages, profile.num_microbatches
    x = [1] * S
    for s in range(S - 2, -1, -1):
        delta = max(required_virtual_slackness(profile, stage_to_rank, s, with_w), slack_floor)
        x[s] = min(N, x[s + 1] + delta)
    return x


def virtual_link_tolerance_ms(
    profile: PipelineProfile, stage_to_rank: Sequence[int], warmup_counts: Sequence[int], rank_link: int
) -> float:
    """Largest one-way delay on ``rank_link`` the warm-up counts absorb: the virtual Eq.1 solved for c,
    the minimum over the stage boundaries the link carries (inf if it carries none)."""
    periods = rank_periods_ms(profile, stage_to_rank)
    out = math.inf
    for s in range(profile.num_stages - 1):
        if {stage_to_rank[s], stage_to_rank[s + 1]} == {rank_link, rank_link + 1}:
            delta = warmup_counts[s] - warmup_counts[s + 1]
            slack = delta * periods[stage_to_rank[s + 1]] - profile.f_ms[s] - profile.b_ms[s + 1]
            out = min(out, slack / 2.0)
    return out


# ----------------------------------------------------------------------------- generator
def generate_virtual_order(
    profile: PipelineProfile,
    stage_to_rank: Sequence[int],
    warmup_counts: Sequence[int],
    inflight_limit: Sequence[int] | None = None,
) -> GeneratedSchedule:
    """PipeMorph Alg.3/4 over a stage graph with several stages per rank, event-driven and exact.

    A rank decides when it is free (or when an input reaches it idle): among its stages' ready
    operations it runs a backward-input I > F > W; among I's and among F's the lowest microbatch first
    (which is also the deepest stage: a stage only receives microbatches its upstream stage finished),
    among W's the oldest. A stage's I is eligible once the stage has run its ``x_s`` warm-up forwards
    (Alg.3's warm-up phase); its F only while its in-flight activations (F done − I done) are below
    ``inflight_limit[s]`` (default x_s). Messages follow ``timing.LinkQueues`` on the channels (src rank,
    dst rank); a boundary inside one rank is free. Returns rank → ops and the generator's makespan.
    """
    S, N = profile.num_stages, profile.num_microbatches
    s2r = list(stage_to_rank)
    x = [int(v) for v in warmup_counts]
    limit = list(x) if inflight_limit is None else [int(v) for v in inflight_limit]
    if len(s2r) != S or len(x) != S or len(limit) != S:
        raise ValueError(f"stage_to_rank, warmup_counts and inflight_limit need one entry per stage ({S})")
    for s in range(S):
        if not 1 <= x[s] <= min(N, limit[s]):
            raise ValueError(f"warmup_counts[{s}] = {x[s]} must be within 1..min(N, inflight_limit[{s}])")
        if s and x[s] > limit[s - 1]:
            raise ValueError(f"warmup_counts[{s}] = {x[s]} exceeds the upstream cap {limit[s - 1]}: it would deadlock")
    R = max(s2r) + 1
    own = [[s for s in range(S) if s2r[s] == r] for r in range(R)]
    dur = {"F": [to_ns(v) for v in profile.f_ms], "I": [to_ns(v) for v in profile.b_ms],
           "W": [to_ns(v) for v in profile.w_ms]}
    links = LinkQueues(profile.links)
    f_q: list[deque] = [deque() for _ in range(S)]
    b_q: list[deque] = [deque() for _ in range(S)]
    w_q: list[deque] = [deque() for _ in range(S)]
    f_q[0].extend((0, m) for m in range(N))
    f_count, b_count = [0] * S, [0] * S
    free_at = [0] * R
    order: dict[int, list[Op]] = {r: [] for r in range(R)}
    remaining, makespan = 3 * N * S, 0
    wake = [(0, r) for r in range(R)]

    def send(s: int, dst_stage: int, done: int, queue: deque, mb: int) -> None:
        src, dst = s2r[s], s2r[dst_stage]
        arrive = done if src == dst else links.send(min(s, dst_stage), (src, dst), done)
        queue.append((arrive, mb))
        if dst != src:
            heapq.heappush(wake, (arrive, dst))

    while remaining:
        if not wake:
            raise RuntimeError("generator stalled: no rank can make progress")  # unreachable for valid x
        t, r = heapq.heappop(wake)
        if free_at[r] > t:
            continue
        pick = None  # (priority tuple, stage, kind)
        for s in own[r]:
            if b_q[s] and b_q[s][0][0] <= t and f_count[s] >= x[s]:
                key = (0, b_q[s][0][1], -s)
            elif f_q[s] and f_q[s][0][0] <= t and f_count[s] - b_count[s] < limit[s]:
                key = (1, f_q[s][0][1], -s)
            elif w_q[s]:
                key = (2, w_q[s][0][0], -s)
            else:
                continue
            if pick is None or key < pick[0]:
                pick = (key, s, "IFW"[key[0]])
        if pick is None:
            continue  # idle until an arrival wakes it
        _, s, kind = pick
        mb = (f_q if kind == "F" else b_q if kind == "I" else w_q)[s].popleft()[1]
        done = t + dur[kind][s]
        if kind == "F":
            f_count[s] += 1
            if s + 1 < S:
                send(s, s + 1, done, f_q[s + 1], mb)
            else:
                b_q[s].append((done, mb))
        elif kind == "I":
            b_count[s] += 1
            w_q[s].append((done, mb))
            if s > 0:
                send(s, s - 1, done, b_q[s - 1], mb)
        order[r].append((s, kind, mb))
        makespan = max(makespan, done)
        free_at[r] = done
        remaining -= 1
        heapq.heappush(wake, (done, r))
    return GeneratedSchedule(order, to_ms(makespan))


# ----------------------------------------------------------------------------- portfolio planner
def plan_virtual(
    profile: PipelineProfile,
    num_virtual_stages: int = 2,
    placement: str = "v",
    *,
    schedule: str = "pipemorph",
    stage_times_ms: tuple[Sequence[float], Sequence[float], Sequence[float]] | None = None,
    memory_limit: int | None = None,
    validate: bool = True,
    full_backward: bool = True,
) -> PlanResult:
    """Plan R ranks × V stages per rank for the rank-level ``profile`` (R ranks, R−1 rank links).

    ``schedule="pipemorph"``: a portfolio — our generator with the virtual-stage warm-up rule (slack
    floor 1 and 2; in-flight capped at x_s, or uncapped), torch's own built-ins for the placement
    (V = 2: Interleaved1F1B / InterleavedZeroBubble for "loop", ZBVZeroBubble / DualPipeV for "v") and
    CrossWave ("v", V = 2) — each simulated by ``simulate`` under the profile; the fastest is kept
    (ties: fewer activations held per rank, then the first in that order), so the result is never
    slower than the built-ins it saw.
    ``schedule="crosspipe-wave"``: CrossWave alone ("v", V = 2). ``memory_limit``: at most that many
    in-flight activations per stage (our plans are capped; other candidates above it are dropped).
    ``full_backward=False``: only split-backward (I + W) candidates (drops Interleaved1F1B, DualPipeV).
    The returned plan has passed ``validate_plan`` (torch's lowering and dry run included).
    """
    from .validate import validate_plan

    if schedule not in VIRTUAL_SCHEDULES:
        raise ValueError(f"schedule must be one of {VIRTUAL_SCHEDULES}, got {schedule!r}")
    if memory_limit is not None and memory_limit < 1:
        raise ValueError(f"memory_limit must be >= 1 activation, got {memory_limit}")
    if schedule == "crosspipe-wave" and (placement != "v" or num_virtual_stages != 2):
        raise ValueError("crosspipe-wave plans the V-shape placement with 2 stages per rank (--placement v)")
    if validate:
        torch_schedules()  # import torch's IR before the clock starts: plan_ms measures planning only
    t0 = time.perf_counter()
    stage_profile, s2r = virtual_profile(profile, num_virtual_stages, placement, stage_times_ms=stage_times_ms)
    with gc_paused():
        members = _candidates(stage_profile, s2r, placement, schedule, memory_limit)
        if not full_backward:
            members = {k: v for k, v in members.items()
                       if not any(kind == "B" for ops in v[0].values() for _, kind, _ in ops)}
        scores = {}
        for name, (ops, x, limit) in members.items():
            score = _score(ops, stage_profile, s2r, memory_limit)
            if score is not None:
                scores[name] = score
        if not scores:
            raise ValueError(f"no {schedule} candidate fits memory_limit = {memory_limit} activations per stage")
        best = min(scores, key=scores.get)  # dicts keep insertion order: full ties go to the first
        feasible = {k: v[0] for k, v in scores.items()}
        ops, x, limit = members[best]
        if validate:
            validate_plan(ops, stage_profile.num_stages, stage_profile.num_microbatches, inflight_limit=limit)
        result = make_result(ops, schedule=schedule, source=best, warmup_counts=x, predicted_makespan_ms=feasible[best],
                             plan_ms=0.0, stage_to_rank=s2r, profile=stage_profile, candidates=feasible,
                             inflight_limit=_inflight_limit(limit, memory_limit, len(s2r)))
    result.plan_ms = (time.perf_counter() - t0) * 1e3
    return result


def _inflight_limit(limit, memory_limit: int | None, num_stages: int) -> list[int] | None:
    """The per-stage in-flight limit to validate the winner with: its own cap, else the memory limit."""
    if limit is not None:
        return list(limit)
    return None if memory_limit is None else [memory_limit] * num_stages


_Member = tuple[dict[int, list[Op]], "list[int] | None", "list[int] | int | None"]  # ops, x, in-flight cap


def _candidates(stage_profile, s2r, placement, schedule, memory_limit) -> dict[str, _Member]:
    S, N = stage_profile.num_stages, stage_profile.num_microbatches
    V = S // (max(s2r) + 1)
    out: dict[str, _Member] = {}
    if schedule == "pipemorph":
        cap = N if memory_limit is None else min(N, memory_limit)
        for floor in (1, 2):
            x = [min(v, cap) for v in virtual_warmup_counts(stage_profile, s2r, slack_floor=floor)]
            for capped in (True, False):
                limit = list(x) if capped else [cap] * S
                gen = generate_virtual_order(stage_profile, s2r, x, limit)
                out[f"pipemorph(floor={floor},{'capped' if capped else 'uncapped'})"] = (gen.order, x, limit)
        if V == 2:
            out.update(_builtin_members(PLACEMENT_BUILTINS[placement], S // 2, N, s2r))
    if placement == "v" and V == 2:
        from .crosspipe import plan_crosspipe

        per_rank = None if memory_limit is None else 2 * memory_limit
        try:
            wave = plan_crosspipe(stage_profile, "wave", memory_limit=per_rank, validate=False)
        except ValueError:  # no CrossWave schedule fits the limit: only fatal when it is the one asked for
            if schedule == "crosspipe-wave":
                raise
        else:
            out["crosswave"] = (as_ops(wave.actions), None, None)
    return out


def _builtin_members(names, num_ranks, num_microbatches, s2r) -> dict[str, _Member]:
    """torch's own schedules for this placement (skipped where torch rejects the shape)."""
    from .builtin import builtin_plan

    out: dict[str, _Member] = {}
    for name in names:
        try:
            plan, placement = builtin_plan(name, num_ranks, num_microbatches)
        except ValueError:
            continue
        if tuple(placement[s] for s in range(len(s2r))) == tuple(s2r):
            out[f"torch:{name}"] = (as_ops(plan), None, None)
    return out


def _score(ops, stage_profile, s2r, memory_limit) -> tuple[float, int] | None:
    """(simulated makespan, most activations a rank holds) of one candidate; None when a stage holds
    more than ``memory_limit``."""
    from .simulate import simulate

    timeline = simulate(ops, stage_profile, stage_to_rank=dict(enumerate(s2r)))
    if memory_limit is not None and max(timeline.peak_inflight.values()) > memory_limit:
        return None
    return timeline.makespan_ms, max(rank_peak_inflight(ops).values())


def rank_peak_inflight(ops) -> dict[int, int]:
    """Per rank, the most activations (of its stages) held at once, program order
    (``plan.result.rank_peak_memory`` in stage activations)."""
    ops = as_ops(ops)
    return {rank: int(v) for rank, v in zip(sorted(ops), rank_peak_memory(ops))}
