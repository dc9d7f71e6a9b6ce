"""Planning with several stages per rank (virtual stages), looped or V-shaped (docs/multistage.md).

R ranks each hold V model chunks ("stages"), S = R·V in data-flow order. Placements:

* ``"loop"`` — rank r holds stages r, r+R, r+2R, … (torch's Interleaved1F1B / InterleavedZeroBubble);
* ``"v"`` — zig-zag: rank r holds r and 2R−1−r (and so on for larger V), torch's ZBV / DualPipeV.

Rank link ℓ joins PP ranks ℓ and ℓ+1 and carries both directions of every stage boundary that crosses
it (its two directions are the channels of ``timing.LinkQueues``); a boundary between two stages on
one rank is free, and so is the wrap-around boundary of a looped placement (rank R−1 → rank 0), as in
``simulate``'s rank-level model.

PipeMorph's warm-up adaptation generalised to virtual stages (docs/multistage.md derives it per loop):
the boundary s → s+1, carried by a link of one-way delay c (0 inside one rank), closes the loop
F_s(m) → c → F_{s+1}(m) … B_{s+1}(m) → c → B_s(m); with Δ_s = x_s − x_{s+1} and
K_s = t^F_s + t^B_{s+1} + 2c,

    sufficient (the rule):  K_s ≤ Δ_s · T,   T = max_r Σ_{u on r} (t^F_u + t^B_u)   (every boundary)
    necessary:              x_s · T0 ≥ t^B_s + t^F_{S−1} + Σ_{u ≥ s} K_u            (every stage)

T is the slowest rank's F + B time per microbatch, a lower bound on the pipeline's common steady-state
period (W can be deferred, so only F and B are sure to fill it); T0 is the plan's own steady-state
period without the delay. The necessary condition sums the loops below s: a boundary with surplus
lends it to those above, so the per-boundary rule is not tight. Measured on random heterogeneous
cases (tested): the rule's counts never cascade (the delay's cost does not grow with N), and every
plan violating the necessary condition cascades; neither is proven in general.
For V = 1 and uniform stages the rule is the paper's Eq.1; with
heterogeneous stages it differs (the pair t^F_s + t^B_{s+1} and the bottleneck's period). For uniform
ranks (t split into V chunks of t/V) it reads c ≤ (Δ_s − 1/V)·t. The schedule is then generated
event-driven over the stage graph (Alg.3/4 with several stages per rank: B(I) > F > W, per-stage
warm-up x_s and in-flight cap L_s); under a memory limit (per rank: K activations of the rank's whole
model part, a chunk counting 1/V; or per stage) ``search_warmup`` spends each rank's budget where the
delay needs it, with the generator (exact) as the judge. A portfolio keeps the fastest of these,
torch's own built-ins for the placement and (V-shape) CrossWave, all simulated by ``simulate`` and
the winner checked by ``validate_plan``.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from .deps import KIND_INDEX, ROOT, table
from .ir import Op, as_ops, gc_paused, torch_schedules
from .pipemorph import GeneratedSchedule
from .placement import PLACEMENTS, stage_profile, stage_to_rank
from .profile import PipelineProfile
from .result import PlanResult, make_result, peak_inflight, peak_memory_per_rank, rank_peak_inflight  # noqa: F401 (re-exported)
from .timing import LinkQueues, to_ms, to_ns
from .validate import compiled_core

_CORE = compiled_core()

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
    if V == 1 and stage_times_ms is None:
        return profile, s2r
    # the virtual planner caps memory with ``memory_limit`` alone (as before): no byte budget
    plain = replace(profile, activation_bytes=None, memory_budget_bytes=None)
    return stage_profile(plain, s2r, stage_times_ms), s2r


# ----------------------------------------------------------------------------- warm-up rule
def rank_periods_ms(profile: PipelineProfile, stage_to_rank: Sequence[int], with_w: bool = False) -> list[float]:
    """P_r = Σ over rank r's stages of t^F + t^B (+ t^W with ``with_w``): rank r's time per microbatch."""
    R = max(stage_to_rank) + 1
    out = [0.0] * R
    for s, r in enumerate(stage_to_rank):
        out[r] += profile.f_ms[s] + profile.b_ms[s] + (profile.w_ms[s] if with_w else 0.0)
    return out


def loop_need_ms(profile: PipelineProfile, stage_to_rank: Sequence[int], boundary: int) -> float:
    """K_s = t^F_s + t^B_{s+1} + 2c_s: what the loop of boundary s adds to stage s's residence time
    (c_s = 0 on a same-rank boundary)."""
    s = boundary
    c = profile.links[s].delay_ms if stage_to_rank[s] != stage_to_rank[s + 1] else 0.0
    return profile.f_ms[s] + profile.b_ms[s + 1] + 2.0 * c


def required_virtual_slackness(profile: PipelineProfile, stage_to_rank: Sequence[int], boundary: int) -> int:
    """Smallest Δ_s ≥ 1 with K_s ≤ Δ_s · T, T = max_r P_r (F + B): the sufficient condition of the
    virtual-stage Eq.1 (docs/multistage.md)."""
    period = max(rank_periods_ms(profile, stage_to_rank))
    return max(1, math.ceil(loop_need_ms(profile, stage_to_rank, boundary) / period - 1e-9))


def necessary_warmup_counts(profile: PipelineProfile, stage_to_rank: Sequence[int], period_ms: float) -> list[int]:
    """The fewest warm-up forwards per stage that keep a steady-state period ``period_ms`` (T0, the plan's
    own period without the delay) when every stage's in-flight cap is its warm-up count: x_s · T0 ≥
    t^B_s + t^F_{S−1} + Σ_{u ≥ s} K_u (docs/multistage.md). A necessary condition, summed over the loops
    below s: a boundary with surplus (Δ_u·T0 > K_u) lends it to the ones above, which is why the rule's
    per-boundary Δ (sufficient) can hold more than needed."""
    if period_ms <= 0:
        raise ValueError(f"period_ms must be > 0, got {period_ms}")
    S = profile.num_stages
    out, acc = [1] * S, 0.0
    for s in range(S - 2, -1, -1):
        acc += loop_need_ms(profile, stage_to_rank, s)
        need = profile.b_ms[s] + profile.f_ms[S - 1] + acc
        out[s] = max(1, math.ceil(need / period_ms - 1e-9))
    return out


def virtual_warmup_counts(
    profile: PipelineProfile, stage_to_rank: Sequence[int], *, slack_floor: int = 1
) -> list[int]:
    """Per-stage warm-up counts: x_{S−1} = 1, x_s = min(N, x_{s+1} + max(Δ_s required, floor)).

    With no delay and floor 1 this is x_s = S − s, the per-stage peak of torch's InterleavedZeroBubble
    and ZBV (PipeMorph Alg.2's recursion over the stage graph)."""
    if slack_floor < 1:
        raise ValueError(f"slack_floor must be >= 1, got {slack_floor}")
    S, N = profile.num_stages, profile.num_microbatches
    x = [1] * S
    for s in range(S - 2, -1, -1):
        delta = max(required_virtual_slackness(profile, stage_to_rank, s), slack_floor)
        x[s] = min(N, x[s + 1] + delta)
    return x


def virtual_link_tolerance_ms(
    profile: PipelineProfile, stage_to_rank: Sequence[int], warmup_counts: Sequence[int], rank_link: int
) -> float:
    """Largest one-way delay on ``rank_link`` the warm-up counts absorb by the rule (sufficient): K_s ≤ Δ_s·T
    solved for c, the minimum over the stage boundaries the link carries (inf if it carries none)."""
    period = max(rank_periods_ms(profile, stage_to_rank))
    out = math.inf
    for s in range(profile.num_stages - 1):
        if {stage_to_rank[s], stage_to_rank[s + 1]} == {rank_link, rank_link + 1}:
            delta = warmup_counts[s] - warmup_counts[s + 1]
            out = min(out, (delta * period - profile.f_ms[s] - profile.b_ms[s + 1]) / 2.0)
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
    ``inflight_limit[s]`` (default x_s). It finishes iff x_s ≤ min_{u ≤ s} L_u for every s (checked): no
    backward runs before stage s has x_s forwards, and those pass every upstream stage, which holds them
    all until its own first backward. Messages follow ``timing.LinkQueues`` on the channels (src rank,
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
        if s and x[s] > min(limit[:s]):
            raise ValueError(f"warmup_counts[{s}] = {x[s]} exceeds the upstream cap {min(limit[:s])}: it would deadlock")
    order, makespan = _virtual_loop(profile, s2r, x, limit)
    return GeneratedSchedule(order, to_ms(makespan))


def _virtual_loop(profile: PipelineProfile, s2r: list[int], x: list[int], limit: list[int]) -> tuple[dict, int]:
    """:func:`_virtual_loop_py`, compiled where built (``_pipemorph.c``; bit-identical, tested)."""
    if _CORE is None:
        return _virtual_loop_py(profile, s2r, x, limit)
    links = LinkQueues(profile.links)
    order, makespan = _CORE.generate_virtual(
        table(profile.num_stages).spec(), profile.num_microbatches, s2r, [to_ns(v) for v in profile.f_ms], [to_ns(v) for v in profile.b_ms],
        [to_ns(v) for v in profile.w_ms], links.latency_ns, links.transfer_ns, x, limit, profile.release == "W")
    return dict(enumerate(order)), makespan


def _virtual_loop_py(profile: PipelineProfile, s2r: list[int], x: list[int], limit: list[int]) -> tuple[dict, int]:
    """The event loop of :func:`generate_virtual_order` (the Python reference): rank → ops, makespan (ns)."""
    S, N = profile.num_stages, profile.num_microbatches
    R = max(s2r) + 1
    own = [[s for s in range(S) if s2r[s] == r] for r in range(R)]
    dur = {"F": [to_ns(v) for v in profile.f_ms], "I": [to_ns(v) for v in profile.b_ms],
           "W": [to_ns(v) for v in profile.w_ms]}
    links = LinkQueues(profile.links)
    # arrival queues per op class (deps.table), fed along the table: same rank at once, else by message
    deps = table(S)
    queues: list[deque] = [deque() for _ in range(3 * S)]
    for q, trigger in enumerate(deps.trigger):
        if trigger == ROOT:
            queues[q].extend((0, m) for m in range(N))
    f_q, b_q, w_q = queues[0::3], queues[1::3], queues[2::3]
    f_count, b_count = [0] * S, [0] * S  # forwards done, activations released (profile.RELEASES)
    release_w = profile.release == "W"
    free_at = [0] * R
    order: dict[int, list[Op]] = {r: [] for r in range(R)}
    remaining, makespan = 3 * N * S, 0
    wake = [(0, r) for r in range(R)]

    def feed(q: int, done: int, mb: int) -> None:
        src = s2r[q // 3]
        for c in deps.feeds_of(q):
            dst = s2r[c // 3]
            arrive = done if src == dst else links.send(deps.link[c], (src, dst), done)
            queues[c].append((arrive, mb))
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
        elif kind == "I":
            if not release_w:
                b_count[s] += 1
        elif release_w:
            b_count[s] += 1
        feed(3 * s + KIND_INDEX[kind], done, mb)
        order[r].append((s, kind, mb))
        makespan = max(makespan, done)
        free_at[r] = done
        remaining -= 1
        heapq.heappush(wake, (done, r))
    return order, makespan


# ----------------------------------------------------------------------------- memory per rank
def rank_chunk_budget(memory_limit: float, stages_per_rank: int) -> int:
    """A per-rank limit K (whole-rank activations) as chunk activations: K·V, which must be a whole
    number ≥ V (every stage of the rank holds at least one activation in any schedule)."""
    chunks = memory_limit * stages_per_rank
    if not math.isfinite(chunks) or abs(chunks - round(chunks)) > 1e-9 or round(chunks) < stages_per_rank:
        raise ValueError(f"memory_limit per rank must be >= 1 and a multiple of 1/{stages_per_rank} "
                         f"(one chunk of {stages_per_rank} per rank), got {memory_limit}")
    return int(round(chunks))


# ----------------------------------------------------------------------------- budgeted search
@dataclass
class Budget:
    """Memory a multi-stage plan may hold: ``per_rank[r]`` chunk activations on rank r and ``per_stage``
    on every stage (None: unlimited), counted under ``release`` (``profile.RELEASES``)."""

    per_rank: tuple[int, ...] | None = None
    per_stage: int | None = None
    release: str = "I"

    @classmethod
    def of(cls, memory_limit, stage_memory_limit: int | None, num_ranks: int, stages_per_rank: int,
           release: str = "I") -> "Budget":
        """``memory_limit``: K for every rank, or one K per rank (whole-rank activations)."""
        if memory_limit is None:
            return cls(None, stage_memory_limit, release)
        limits = list(memory_limit) if isinstance(memory_limit, Sequence) else [memory_limit] * num_ranks
        if len(limits) != num_ranks:
            raise ValueError(f"memory_limit has {len(limits)} entries, expected one per rank ({num_ranks})")
        return cls(tuple(rank_chunk_budget(k, stages_per_rank) for k in limits), stage_memory_limit, release)

    @property
    def limited(self) -> bool:
        return self.per_rank is not None or self.per_stage is not None

    def over(self, ops) -> list[int]:
        """The ranks holding more than their budget."""
        if self.per_rank is None:
            return []
        return [r for r, p in rank_peak_inflight(ops, self.release).items() if p > self.per_rank[r]]

    def fits(self, ops, stage_peaks: Mapping[int, int] | None = None) -> bool:
        """Whether a plan (ops) keeps every rank and every stage within the budget."""
        if self.over(ops):
            return False
        if self.per_stage is not None:
            peaks = peak_inflight(ops, self.release) if stage_peaks is None else stage_peaks
            return max(peaks.values()) <= self.per_stage
        return True


def _repair(stage_profile, s2r, x: Sequence[int], budget: Budget) -> tuple[list[int], list[int]] | None:
    """Fit warm-up counts ``x`` (in-flight caps L = x) into the budget: while a rank holds more than its
    budget (exactly, by generating the order), lower the largest cap on that rank by one — so a rank's
    budget goes to the stages whose Eq.1 need is largest, not evenly."""
    S, N = stage_profile.num_stages, stage_profile.num_microbatches
    cap = N if budget.per_stage is None else min(N, budget.per_stage)
    L = [max(1, min(v, cap)) for v in x]
    for _ in range(S * N + 1):
        x = [min(L[: s + 1]) for s in range(S)]  # the most warm-up the caps allow (no stall)
        gen = _generate_or_none(stage_profile, s2r, x, L)
        if gen is None:
            return None
        over = budget.over(gen.order)
        if not over:
            return x, L
        for r in over:
            mine = [s for s in range(S) if s2r[s] == r and L[s] > 1]
            if not mine:
                return None
            s = max(mine, key=lambda u: (L[u], -u))
            L[s] -= 1
    return None


def search_warmup(
    stage_profile: PipelineProfile,
    stage_to_rank: Sequence[int],
    budget: Budget,
    seeds: Sequence[Sequence[int]],
    max_evals: int = 800,
) -> tuple[list[int], list[int], GeneratedSchedule] | None:
    """Warm-up counts x_s and in-flight caps L_s per stage under ``budget``, by local search with the
    generator as the judge (its makespan is ``simulate``'s, exact).

    Each seed (e.g. the virtual-stage Eq.1 counts) is first fitted into the budget (``_repair``); then,
    from each, descent over the moves x_s ± 1, L_s ± 1, both ± 1, and one cap unit moved
    between two stages of one rank (re-splitting that rank's budget), until no move is faster or
    ``max_evals`` plans were generated. Ties go to less memory (max per-rank peak, then Σ L).
    Returns (x, L, generated schedule), or None when no seed fits.
    """
    S, N = stage_profile.num_stages, stage_profile.num_microbatches
    s2r = list(stage_to_rank)
    cap = N if budget.per_stage is None else min(N, budget.per_stage)
    seen: dict[tuple, tuple | None] = {}

    def evaluate(x, L):
        key = (tuple(x), tuple(L))
        if key not in seen:
            seen[key] = None
            ok = all(1 <= x[s] <= min(L[: s + 1]) and L[s] <= cap for s in range(S))
            gen = _generate_or_none(stage_profile, s2r, x, L) if ok else None
            if gen is not None:
                if budget.fits(gen.order):
                    peak = max(rank_peak_inflight(gen.order, budget.release).values())
                    seen[key] = ((gen.makespan_ms, peak, sum(L)), list(x), list(L), gen)
        return seen[key]

    pairs = [(s, u) for s in range(S) for u in range(S) if s != u and s2r[s] == s2r[u]]
    best = None
    for seed in seeds:  # descend from every seed: their basins differ (delay-shaped vs memory-shaped)
        fitted = _repair(stage_profile, s2r, seed, budget)
        here = fitted and evaluate(*fitted)
        improved = bool(here)
        while improved and len(seen) < max_evals:
            improved = False
            _, x0, L0, _ = here
            for x, L in _moves(x0, L0, pairs):
                got = evaluate(x, L)
                if got and got[0] < here[0]:
                    here, improved = got, True
        if here and (best is None or here[0] < best[0]):
            best = here
    if best is None:
        return None
    return best[1], best[2], best[3]


def _generate_or_none(stage_profile, s2r, x, L) -> GeneratedSchedule | None:
    try:
        return generate_virtual_order(stage_profile, s2r, x, L)
    except RuntimeError:  # stalled; cannot happen for x_s ≤ min_{u≤s} L_u, which callers ensure
        return None


def _moves(x0, L0, pairs):
    S = len(x0)
    for s in range(S):
        for dx, dl in ((1, 0), (-1, 0), (0, 1), (0, -1), (1, 1), (-1, -1)):
            x, L = list(x0), list(L0)
            x[s] += dx
            L[s] += dl
            yield x, L
    for s, u in pairs:  # one unit of the rank's budget from u to s
        x, L = list(x0), list(L0)
        L[s] += 1
        L[u] -= 1
        x[s] = min(x[s] + 1, L[s])
        x[u] = min(x[u], L[u])
        yield x, L


# ----------------------------------------------------------------------------- portfolio planner
def plan_virtual(
    profile: PipelineProfile,
    num_virtual_stages: int = 2,
    placement: str = "v",
    *,
    schedule: str = "pipemorph",
    stage_times_ms: tuple[Sequence[float], Sequence[float], Sequence[float]] | None = None,
    memory_limit: float | Sequence[float] | None = None,
    stage_memory_limit: int | None = None,
    validate: bool = True,
    full_backward: bool = True,
) -> PlanResult:
    """Plan R ranks × V stages per rank for the rank-level ``profile`` (R ranks, R−1 rank links).

    ``schedule="pipemorph"``: a portfolio — our generator with the virtual-stage warm-up rule (slack
    floor 1 and 2; in-flight capped at x_s, or uncapped), under a memory limit the budgeted search
    (``search_warmup``: x_s and caps L_s per stage, seeded by the rule, the no-delay counts S − s and
    all-ones, fitted into the budget and improved by local search with the generator as judge), torch's own built-ins
    for the placement (V = 2: Interleaved1F1B / InterleavedZeroBubble for "loop", ZBVZeroBubble /
    DualPipeV for "v") and CrossWave ("v", V = 2) — each simulated by ``simulate`` under the profile;
    the fastest that fits the memory limits is kept (ties: fewer activations held per rank, then the
    first in that order), so the result is never slower than the built-ins that fit.
    ``schedule="crosspipe-wave"``: CrossWave alone ("v", V = 2).
    ``memory_limit`` K: at most K activations of a rank's whole model part on any rank (a chunk counts
    1/V; K·V whole, ≥ V), or one K per rank. ``stage_memory_limit``: at most that many activations on any one stage.
    ``full_backward=False``: only split-backward (I + W) candidates (drops Interleaved1F1B, DualPipeV).
    The returned plan has passed ``validate_plan`` (torch's lowering and dry run included).
    """
    from ..args import int_arg
    from .profile import profile_arg
    from .validate import validate_plan

    profile_arg(profile)
    int_arg(num_virtual_stages, "num_virtual_stages", 1)
    if schedule not in VIRTUAL_SCHEDULES:
        raise ValueError(f"schedule must be one of {VIRTUAL_SCHEDULES}, got {schedule!r}")
    if stage_memory_limit is not None and stage_memory_limit < 1:
        raise ValueError(f"stage_memory_limit must be >= 1 activation, got {stage_memory_limit}")
    budget = Budget.of(memory_limit, stage_memory_limit, profile.num_stages, num_virtual_stages, profile.release)
    if schedule == "crosspipe-wave" and (placement != "v" or num_virtual_stages != 2):
        raise ValueError("crosspipe-wave plans the V-shape placement with 2 stages per rank (--placement v)")
    if validate:
        torch_schedules()  # import torch's IR before the clock starts: plan_ms measures planning only
    t0 = time.perf_counter()
    stage_profile, s2r = virtual_profile(profile, num_virtual_stages, placement, stage_times_ms=stage_times_ms)
    with gc_paused():
        members = _candidates(stage_profile, s2r, placement, schedule, budget)
        if not full_backward:
            members = {k: v for k, v in members.items()
                       if not any(kind == "B" for ops in v[0].values() for _, kind, _ in ops)}
        scores = {}
        for name, (ops, x, limit) in members.items():
            score = _score(ops, stage_profile, s2r, budget)
            if score is not None:
                scores[name] = score
        if not scores:
            raise ValueError(f"no {schedule} candidate fits the memory limit ({_describe(budget, num_virtual_stages)})")
        best = min(scores, key=scores.get)  # dicts keep insertion order: full ties go to the first
        feasible = {k: v[0] for k, v in scores.items()}
        ops, x, limit = members[best]
        if validate:
            validate_plan(ops, stage_profile.num_stages, stage_profile.num_microbatches, inflight_limit=limit,
                          release=stage_profile.release)
        result = make_result(ops, schedule=schedule, source=best, warmup_counts=x, predicted_makespan_ms=feasible[best],
                             plan_ms=0.0, stage_to_rank=s2r, profile=stage_profile, candidates=feasible,
                             inflight_limit=_inflight_limit(limit, stage_memory_limit, len(s2r)))
    result.plan_ms = (time.perf_counter() - t0) * 1e3
    return result


def _inflight_limit(limit, stage_memory_limit: int | None, num_stages: int) -> list[int] | None:
    """The per-stage in-flight limit to validate the winner with: its own caps, else the per-stage limit."""
    if isinstance(limit, list):
        return list(limit)
    return None if stage_memory_limit is None else [stage_memory_limit] * num_stages


def _describe(budget: Budget, V: int) -> str:
    parts = []
    if budget.per_rank is not None:
        ks = sorted({k / V for k in budget.per_rank})
        parts.append(f"{ks[0]:g} activations per rank" if len(ks) == 1 else
                     f"{[k / V for k in budget.per_rank]} activations per rank")
    if budget.per_stage is not None:
        parts.append(f"{budget.per_stage} per stage")
    return ", ".join(parts) or "none"


_Member = tuple[dict[int, list[Op]], "list[int] | None", "list[int] | int | None"]  # ops, x, in-flight cap


def _candidates(stage_profile, s2r, placement, schedule, budget: Budget) -> dict[str, _Member]:
    S, N = stage_profile.num_stages, stage_profile.num_microbatches
    V = S // (max(s2r) + 1)
    out: dict[str, _Member] = {}
    if schedule == "pipemorph":
        cap = N if budget.per_stage is None else min(N, budget.per_stage)
        rules = [virtual_warmup_counts(stage_profile, s2r, slack_floor=floor) for floor in (1, 2)]
        for floor, rule in zip((1, 2), rules):
            x = [min(v, cap) for v in rule]
            for capped in (True, False):
                limit = list(x) if capped else [cap] * S
                gen = generate_virtual_order(stage_profile, s2r, x, limit)
                out[f"pipemorph(floor={floor},{'capped' if capped else 'uncapped'})"] = (gen.order, x, limit)
        seeds = [*rules, [S - s for s in range(S)], [1] * S]
        found = search_warmup(stage_profile, s2r, budget, seeds) if budget.limited else None
        if found is not None:
            x, limit, gen = found
            out["pipemorph(search)"] = (gen.order, x, limit)
        if V == 2:
            out.update(_builtin_members(PLACEMENT_BUILTINS[placement], S // 2, N, s2r))
    if placement == "v" and V == 2:
        from .crosspipe import plan_crosspipe

        per_rank = _wave_limit(budget)
        try:
            wave = plan_crosspipe(stage_profile, "wave", memory_limit=per_rank, validate=False)
        except ValueError:  # no CrossWave schedule fits the limit: only fatal when it is the one asked for
            if schedule == "crosspipe-wave":
                raise
        else:
            out["crosswave"] = (as_ops(wave.actions), None, None)
    return out


def _wave_limit(budget: Budget) -> list[int] | None:
    """CrossWave's per-rank chunk limits for a budget (its per-stage limit is only checked afterwards)."""
    if budget.per_rank is None and budget.per_stage is None:
        return None
    R = len(budget.per_rank) if budget.per_rank is not None else None
    stage = None if budget.per_stage is None else 2 * budget.per_stage
    if R is None:
        return stage
    return [k if stage is None else min(k, stage) for k in budget.per_rank]


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


def _score(ops, stage_profile, s2r, budget: Budget) -> tuple[float, int] | None:
    """(simulated makespan, most activations a rank holds) of one candidate; None when it does not fit
    the budget."""
    from .simulate import simulate

    timeline = simulate(ops, stage_profile, stage_to_rank=dict(enumerate(s2r)))
    if not budget.fits(ops, timeline.peak_inflight):
        return None
    return timeline.makespan_ms, max(rank_peak_inflight(ops, budget.release).values())
