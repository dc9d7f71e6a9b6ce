"""PipeMorph schedule generation (§4.3, Appendix Alg.3 and Alg.4), event-driven and exact.

The paper steps a discrete-time simulator in increments of δ. Here decisions happen exactly when they
can change: when a stage becomes free or when an input arrives at an idle stage. With all times in
integer nanoseconds this equals Alg.4 in the limit δ → 0 (and equals Alg.4 at any δ that divides every
time of the profile), at O(3NS log S) cost instead of O(NS² ⌈t_o/δ⌉).

Operator selection (Alg.3): during warm-up a stage runs only forwards until it has run ``x_i`` of them
(waiting for the next F if none has arrived); then it picks, among the operations whose inputs have
arrived, B (torch's I) > F > W, the lowest microbatch first. Our extension (beyond the paper): an
optional per-stage cap on in-flight activations (F done − I done); a capped stage does not start a new
F and runs W or waits for a B instead. The published Alg.4 appends W to stage i−1 after a B on stage
i; W depends on the B of its own stage, which is what we model.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

from ..args import bool_arg, counts_arg, int_arg, real_arg
from .profile import profile_arg
from .deps import ROOT, table
from .ir import Op, gc_paused, torch_schedules
from .profile import PipelineProfile
from .result import PlanResult, make_result, peak_inflight, warmup_counts_of
from .simulate import replay_makespan_ns
from .timing import LinkQueues, to_ms, to_ns
from .validate import compiled_core, validate_plan
from .warmup import (
    _clip_monotone,
    adapted_warmup_counts,
    initial_warmup_counts,
    one_f_one_b_warmup_counts,
    required_slackness,
    zb_h1_warmup_counts,
    zb_warmup_counts,
)


@dataclass
class GeneratedSchedule:
    """Per-stage operation order and the makespan the generator's own timeline predicts for it."""

    order: dict[int, list[Op]]
    makespan_ms: float


def generate_order(
    profile: PipelineProfile,
    warmup_counts: Sequence[int],
    inflight_limit: Sequence[int] | int | None = None,
    *,
    full_backward: bool = False,
) -> GeneratedSchedule:
    """Alg.3/4 event-driven: the per-stage order of F/I/W for every microbatch (one stage per rank).

    ``full_backward=True`` (our extension): the same Alg.3 priorities with the backward not split —
    each I is replaced by a full B taking ``t_B + t_W`` and no W is scheduled (1F1B-style actions with
    PipeMorph's warm-up counts, for devices where the I/W split costs more than it saves).
    """
    S, N = profile_arg(profile).num_stages, profile.num_microbatches
    bool_arg(full_backward, "full_backward")
    x = counts_arg(warmup_counts, "warmup_counts")
    if len(x) != S:
        raise ValueError(f"warmup_counts has {len(x)} entries, expected num_stages = {S}")
    for i, v in enumerate(x):
        if not 1 <= v <= N:
            raise ValueError(f"warmup_counts[{i}] = {v} must be within 1..num_microbatches ({N})")
    if inflight_limit is None:
        limit = [N] * S
    elif isinstance(inflight_limit, (str, bytes)) or not hasattr(inflight_limit, "__iter__"):
        limit = [int_arg(inflight_limit, "inflight_limit")] * S
    else:
        limit = counts_arg(list(inflight_limit), "inflight_limit")
    if len(limit) != S or min(limit) < 1:
        raise ValueError(f"inflight_limit must be >= 1 per stage, got {inflight_limit!r}")
    for i in range(S):
        if x[i] > limit[i]:
            raise ValueError(f"warmup_counts[{i}] = {x[i]} exceeds inflight_limit[{i}] = {limit[i]}")
    order, makespan, _ = _generate(profile, x, limit, full_backward)
    return GeneratedSchedule(order, to_ms(makespan))


_GENERATE_C = compiled_core()
"""The compiled generator (``_pipemorph.c``, bit-identical to :func:`_generate_py`); None: not built."""


def _generate(profile: PipelineProfile, x: list[int], limit: list[int], full_backward: bool,
              bound_ns: int | None = None) -> tuple[dict[int, list[Op]] | None, int, bool]:
    """:func:`_generate_py`, compiled where built (about two orders of magnitude faster, same result)."""
    if _GENERATE_C is None:
        return _generate_py(profile, x, limit, full_backward, bound_ns)
    tw = [to_ns(v) for v in profile.w_ms]
    tb = [to_ns(v) for v in profile.b_ms]
    if full_backward:
        tb = [b + w for b, w in zip(tb, tw)]
    links = LinkQueues(profile.links)
    order, makespan, cap_bound = _GENERATE_C.generate(
        table(profile.num_stages, full_backward).spec(), profile.num_microbatches, [to_ns(v) for v in profile.f_ms], tb, tw, links.latency_ns, links.transfer_ns,
        x, limit, full_backward, bound_ns, profile.release == "W")
    return (None if order is None else dict(enumerate(order))), makespan, cap_bound


def _generate_py(profile: PipelineProfile, x: list[int], limit: list[int], full_backward: bool,
                 bound_ns: int | None = None) -> tuple[dict[int, list[Op]] | None, int, bool]:
    """The generator proper: ``(order, makespan_ns, cap_bound)``, where ``cap_bound`` says whether the
    in-flight limit ever kept a stage from a forward that had arrived (if not, the same counts without
    the limit give the same order). Stops early with ``(None, t, cap_bound)`` once the plan's makespan
    is certain to exceed ``bound_ns``: an op ends at ``t`` and its stage still has more than
    ``bound_ns − t`` of work left."""
    S, N = profile.num_stages, profile.num_microbatches
    tf = [to_ns(v) for v in profile.f_ms]
    tb = [to_ns(v) for v in profile.b_ms]
    tw = [to_ns(v) for v in profile.w_ms]
    if full_backward:
        tb = [b + w for b, w in zip(tb, tw)]
    links = LinkQueues(profile.links)
    bound = bound_ns if bound_ns is not None else float("inf")

    # Arrival queues per op class (deps.table: 3·stage + kind), (ready_ns, mb), FIFO: each stage consumes a
    # kind in microbatch order. An op's end feeds the classes its class feeds (deps): its own stage's at
    # once, an adjacent stage's when the message arrives.
    deps = table(S, full_backward)
    queues: list[deque] = [deque() for _ in range(3 * S)]
    for q, trigger in enumerate(deps.trigger):
        if trigger == ROOT:
            queues[q].extend((0, m) for m in range(N))
    feeds = [tuple((queues[c], deps.link[c], c // 3) for c in deps.feeds_of(q)) for q in range(3 * S)]
    f_q, b_q, w_q = queues[0::3], queues[1::3], queues[2::3]
    free_at = [0] * S
    warm_left = list(x)
    f_count = [0] * S
    b_count = [0] * S  # activations released: at I, or at W when profile.release == "W" (profile.RELEASES)
    release_w = profile.release == "W"
    remaining = (2 if full_backward else 3) * N * S
    work = [N * (f + b + (0 if full_backward else w)) for f, b, w in zip(tf, tb, tw)]  # left per stage
    order: dict[int, list[Op]] = {i: [] for i in range(S)}
    makespan = 0
    cap_bound = False

    wake: list[tuple[int, int]] = [(0, i) for i in range(S)]
    while remaining:
        if not wake:
            raise ValueError("the warm-up counts and in-flight limits deadlock: no stage can run any more")
        t, i = heapq.heappop(wake)
        if free_at[i] > t:
            continue
        kind = None
        if warm_left[i] > 0:
            if f_q[i] and f_q[i][0][0] <= t:
                kind = "F"
                warm_left[i] -= 1
        elif b_q[i] and b_q[i][0][0] <= t:
            kind = "I"
        elif f_q[i] and f_q[i][0][0] <= t:
            if f_count[i] - b_count[i] < limit[i]:
                kind = "F"
            else:
                cap_bound = True
        if kind is None and w_q[i] and w_q[i][0][0] <= t:
            kind = "W"
        if kind is None:
            continue  # idle until an arrival wakes it
        if kind == "F":
            _, m = f_q[i].popleft()
            done = t + tf[i]
            f_count[i] += 1
            q = 3 * i
        elif kind == "I":
            _, m = b_q[i].popleft()
            done = t + tb[i]
            if full_backward:
                kind = "B"
            if full_backward or not release_w:
                b_count[i] += 1
            q = 3 * i + 1
        else:
            _, m = w_q[i].popleft()
            done = t + tw[i]
            if release_w:
                b_count[i] += 1
            q = 3 * i + 2
        for queue, link, dst in feeds[q]:
            if link < 0:
                queue.append((done, m))
            else:
                arrive = links.send(link, (i, dst), done)
                queue.append((arrive, m))
                heapq.heappush(wake, (arrive, dst))
        work[i] -= done - t
        if done + work[i] > bound:
            return None, done, cap_bound
        order[i].append((i, kind, m))
        makespan = max(makespan, done)
        free_at[i] = done
        remaining -= 1
        heapq.heappush(wake, (done, i))
    return order, makespan, cap_bound


Plan = PlanResult
"""The name docs/ARCHITECTURE.md and the runtime use for a planner's result."""

SCHEDULES = ("pipemorph", "zb", "zb-h1")
BACKWARDS = ("split", "full")
VALIDATE = (True, False, "torch")


@dataclass(frozen=True)
class _Candidate:
    """One plan to compare: warm-up counts, in-flight limit, and how its order is made.

    ``static``: the order is generated as if no link were slow (a fixed schedule), then timed under
    the real profile; otherwise the generator runs under the real profile (its timeline is exact).
    """

    name: str
    warmup_counts: tuple[int, ...]
    inflight_limit: tuple[int, ...]
    static: bool = False
    one_f_one_b: bool = False


def memory_caps(profile: PipelineProfile, memory_limit: int | Sequence[int] | None) -> list[int] | None:
    """Per-stage in-flight activation limit from ``memory_limit`` (one K for every stage, or one per
    stage) and the profile's byte budget (at most N); None when neither is given."""
    caps = profile.max_inflight()
    if memory_limit is None and caps is None:
        return None
    S, N = profile.num_stages, profile.num_microbatches
    limits = list(memory_limit) if isinstance(memory_limit, (list, tuple)) else [memory_limit or N] * S
    if len(limits) != S or any(k < 1 for k in limits):
        raise ValueError(f"memory_limit must be >= 1 activation (or one such per stage), got {memory_limit}")
    caps = list(caps or [N] * S)
    return [max(1, min(c, int(k), N)) for c, k in zip(caps, limits)]


def one_f_one_b_order(num_stages: int, num_microbatches: int) -> dict[int, list[Op]]:
    """The one 1F1B order (torch's Schedule1F1B with full backwards; tests/package/test_one_definition.py
    checks it against torch's own): stage i runs x_i = S − i forwards (at most N:
    ``warmup.one_f_one_b_warmup_counts``), then alternates B and F, then drains its backwards."""
    N = num_microbatches
    order: dict[int, list[Op]] = {}
    for i, x in enumerate(one_f_one_b_warmup_counts(num_stages, N)):
        ops: list[Op] = [(i, "F", m) for m in range(x)]
        for m in range(N):
            ops.append((i, "B", m))
            if x + m < N:
                ops.append((i, "F", x + m))
        order[i] = ops
    return order


def _candidates(profile: PipelineProfile, schedule: str, mode: str, slack_floor: int,
                caps: list[int] | None, cap_inflight: bool) -> list[_Candidate]:
    """The plans ``plan_pipemorph`` compares; the first is the requested schedule as published."""
    S, N = profile.num_stages, profile.num_microbatches
    top = caps or [N] * S

    def fit(x: Sequence[int]) -> tuple[int, ...]:
        return tuple(_clip_monotone(x, top))

    def make(name: str, x: Sequence[int], capped: bool, **kw: bool) -> _Candidate:
        x = fit(x)
        return _Candidate(name, x, x if capped else tuple(max(c, v) for c, v in zip(top, x)), **kw)

    if schedule in ("zb", "zb-h1"):
        x = zb_warmup_counts(S, N) if schedule == "zb" else zb_h1_warmup_counts(S)
        return [make(schedule, x, True, static=True)]
    if mode == "initial":
        variants = [("alg1", initial_warmup_counts(S, top[0]))]
    else:
        variants = [(f"alg2-floor{slack_floor}", adapted_warmup_counts(profile, slack_floor=slack_floor))]
        if slack_floor != 1:
            variants.append(("alg2-floor1", adapted_warmup_counts(profile, slack_floor=1)))
    out = [make(variants[0][0] + ("-capped" if cap_inflight else ""), variants[0][1], cap_inflight)]
    for name, x in variants:
        out += [make(name + "-capped", x, True), make(name, x, False)]
    if mode != "initial" and N - 2 * S < slack_floor:  # Alg.2's clip as published (x = 1 at N = 2S), uncapped
        out.append(make("alg2-literal", adapted_warmup_counts(profile, slack_floor=slack_floor, literal=True), False))
    static = any(link.delay_ms > 0 for link in profile.links)  # else generated = static (dedup)
    out += [make("zb", zb_warmup_counts(S, N), True, static=static),
            make("zb-h1", zb_h1_warmup_counts(S), True, static=static)]
    x = tuple(one_f_one_b_warmup_counts(S, N))
    if all(v <= c for v, c in zip(x, top)):
        out.append(_Candidate("1f1b", x, x, one_f_one_b=True))
    seen: set = set()
    return [c for c in out if (c.warmup_counts, c.inflight_limit, c.static, c.one_f_one_b) not in seen
            and not seen.add((c.warmup_counts, c.inflight_limit, c.static, c.one_f_one_b))]


def _evaluate(profile: PipelineProfile, cand: _Candidate, full: bool,
              bound_ns: int | None) -> tuple[dict[int, list[Op]] | None, int, bool]:
    """``(order, makespan_ns, cap_bound)`` of a candidate under ``profile`` (the one timing model);
    order None when its makespan exceeds ``bound_ns``."""
    S, N = profile.num_stages, profile.num_microbatches
    x, limit = list(cand.warmup_counts), list(cand.inflight_limit)
    if not cand.static and not cand.one_f_one_b:
        return _generate(profile, x, limit, full, bound_ns)
    if cand.one_f_one_b:
        order = one_f_one_b_order(S, N)
    else:
        order = _generate(profile.with_links(()), x, limit, full)[0]
    makespan = replay_makespan_ns(order, profile, bound_ns)
    return (None, 0, False) if makespan is None else (order, makespan, False)


def _fastest(profile: PipelineProfile, cands: list[_Candidate], full: bool,
             hold_margin: float = 0.0) -> tuple[int, _Candidate, dict[int, list[Op]], dict[str, float | None]]:
    """``(makespan_ns, candidate, order, timed)``: the candidate of ``cands`` to deploy under ``profile`` and
    every candidate's makespan in ms (None: pruned, certainly slower than the pick's bound).  Of the candidates
    whose makespan is within ``hold_margin`` (relative) of the fastest, the one holding the fewest activations
    — the warm-up counts its order realises, what it holds when no delay stretches them —, then the earliest:
    with ``hold_margin`` 0 the fastest, and on a tie the leaner (its targets are a lower bound on what it
    holds, so only a candidate whose targets are leaner may tie); a positive margin makes a plan that holds
    more pay for its memory by that much (measured times jitter by a few per cent between windows)."""
    timed: dict[str, float | None] = {}
    done: list[tuple[int, int, int, _Candidate, dict]] = []  # (makespan, activations held, index, cand, order)
    unbound: set = set()  # warm-up counts whose capped order never met its cap
    for index, cand in enumerate(cands):
        if cand.warmup_counts in unbound and not cand.static and not cand.one_f_one_b:
            timed[cand.name] = timed[f"{cand.name}-capped"]  # the cap never bound: the same order
            continue
        bound = None  # above it the candidate cannot be picked (its exact makespan is not needed)
        if done:
            fastest = min(d[0] for d in done)
            if hold_margin > 0:  # within the margin of the fastest (a later, faster one may move the window)
                bound = int(fastest * (1.0 + hold_margin))
            else:  # the fastest, or as fast and leaner than the pick
                bound = fastest - (0 if sum(cand.warmup_counts) < _pick(done, 0.0)[1] else 1)
        if bound is not None and hold_bound_ns(profile, cand.inflight_limit) > bound:
            timed[cand.name] = None
            continue
        order, makespan, cap_bound = _evaluate(profile, cand, full, bound)
        if not cap_bound and cand.inflight_limit == cand.warmup_counts:
            unbound.add(cand.warmup_counts)
        timed[cand.name] = None if order is None else to_ms(makespan)
        if order is not None:
            done.append((makespan, sum(warmup_counts_of(order)), index, cand, order))
    makespan, _, _, best, order = _pick(done, hold_margin)
    return makespan, best, order, timed


def _pick(done: list[tuple[int, int, int, Any, Any]], hold_margin: float) -> tuple[int, int, int, Any, Any]:
    """Of the timed ``(makespan, activations held, index, ...)``, those within ``hold_margin`` of the fastest:
    the leanest, then the earliest."""
    fastest = min(d[0] for d in done)
    return min((d for d in done if d[0] <= fastest * (1.0 + hold_margin)), key=lambda d: (d[1], d[2]))


def hold_bound_ns(profile: PipelineProfile, inflight_limit: Sequence[int]) -> int:
    """A lower bound on the makespan (ns) of any plan holding at most ``inflight_limit[i]`` activations
    on stage i (our memory extension; Little's law on the activations): microbatch m's activation on
    stage i < S−1 lives from F(i, m)'s start to I(i, m)'s end, at least
    H_i = t^F_i + c_i + t^F_{i+1} + t^B_{i+1} + c_i + t^B_i (the gradient's round trip, Theorem 1's 2c_i),
    and at most ``inflight_limit[i]`` live at once, so the makespan is at least N · H_i / limit_i."""
    S, N = profile.num_stages, profile.num_microbatches
    f, b = [to_ns(v) for v in profile.f_ms], [to_ns(v) for v in profile.b_ms]
    bound = 0
    for i in range(S - 1):
        c = to_ns(profile.links[i].delay_ms) if profile.links else 0
        hold = f[i] + 2 * c + f[i + 1] + b[i + 1] + b[i]
        bound = max(bound, N * hold // inflight_limit[i])
    return bound


def _notes(profile: PipelineProfile, schedule: str, mode: str, slack_floor: int) -> list[str]:
    """Warn when Alg.2's clip max(N − 2S, floor) leaves a slow link without the slackness it needs."""
    if schedule != "pipemorph" or mode != "adaptive" or profile.num_stages < 2:
        return []
    S, N = profile.num_stages, profile.num_microbatches
    clip = max(N - 2 * S, slack_floor)
    short = [i for i in range(S - 1) if required_slackness(profile, i) > clip]
    if not short:
        return []
    room = f"N = {N} <= 2S = {2 * S}" if N <= 2 * S else f"N - 2S = {N - 2 * S}"
    return [f"Alg.2 has no room: {room}, so the slackness of links {short} is clipped at {clip} "
            f"(they need up to {max(required_slackness(profile, i) for i in short)}); more microbatches "
            f"or schedule 'auto' (CrossPipe) may absorb the delay better"]


def plan_pipemorph(
    profile: PipelineProfile,
    *,
    schedule: str = "pipemorph",
    mode: str = "auto",
    slack_floor: int = 2,
    memory_limit: int | Sequence[int] | None = None,
    cap_inflight: bool = True,
    validate: bool | str = True,
    backward: str = "split",
    candidates: bool = True,
    hold_margin: float = 0.0,
) -> PlanResult:
    """Plan warm-up counts and generate the full schedule; the returned plan has passed validation.

    ``schedule="zb"``: the ZeroBubble plan of PipeMorph Fig.4, x_i = 2(S − i) − 1, generated as if no
    link were slow. ``schedule="zb-h1"``: minimal warm-up x_i = S − i (1F1B's memory), likewise.
    ``schedule="pipemorph"``: ``mode="initial"`` → Alg.1 (§4.2) under the memory limit (N when none);
    ``mode="adaptive"`` → Alg.2 (§4.2) from the profile's measured times and delays; ``mode="auto"`` →
    adaptive when any link has a delay, else initial. With ``candidates`` (default) it also times, under
    the profile, the cheap alternatives — the same warm-up counts without the in-flight cap, Alg.2 with
    slack floor 1, Alg.2 with its clip as published where N − 2S is below the floor (x_i = 1 at N = 2S,
    uncapped: ``adapted_warmup_counts(literal=True)``), the static zb and zb-h1 orders and torch's
    1F1B order — and returns the fastest (ties: the one holding fewer activations — the sum of the
    warm-up counts its order realises —, then the earlier in that list: at 1F1B's memory with no delay,
    1F1B's own counts rather than Alg.1's, which the model times the same and which run slower), so it
    is never slower than any.  ``hold_margin`` m > 0: of the candidates within m (relative) of the fastest,
    the one holding the fewest activations (never more than m slower than any; the runtime plans on measured,
    jittering times with m = 1 %).  The result's ``warmup_counts`` are those its order realises
    (``result.warmup_counts_of``): an uncapped candidate may run more forwards than its targets, and the
    runtime's Eq. 1 tolerances must read what runs.
    ``memory_limit`` K (and the profile's byte budget): every candidate holds at most K in-flight
    activations per stage, so the result is the fastest candidate that fits.
    ``cap_inflight`` (our memory extension): the requested schedule caps in-flight activations at x_i.
    ``validate``: True → our validator (the hot path); "torch" → ours plus torch's lowering and dry run;
    False → none. ``backward="full"`` (our extension): plan with the profile's ``fused()`` times and emit
    full backwards B instead of I/W (the runtime measures both, see ``titan_ext.runtime``).
    """
    profile_arg(profile)
    int_arg(slack_floor, "slack_floor")
    if isinstance(memory_limit, (list, tuple)):  # one per stage
        counts_arg(memory_limit, "memory_limit", profile.num_stages, minimum=1)
    else:
        real_arg(memory_limit, "memory_limit", minimum=1, optional=True)
    bool_arg(cap_inflight, "cap_inflight")
    bool_arg(candidates, "candidates")
    real_arg(hold_margin, "hold_margin", minimum=0)
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if mode not in ("auto", "initial", "adaptive"):
        raise ValueError(f"mode must be auto, initial or adaptive, got {mode!r}")
    if not isinstance(validate, (bool, str)) or validate not in VALIDATE:  # (1 == True: refused, as bool_arg does)
        raise ValueError(f"validate must be True, False or 'torch', got {validate!r}")
    if slack_floor < 1:
        raise ValueError(f"slack_floor must be >= 1, got {slack_floor}")
    torch_schedules()  # import torch's IR before the clock starts: plan_ms measures planning only
    t0 = time.perf_counter()
    full = backward == "full"
    if full:
        profile = profile.fused()
    if mode == "auto":
        mode = "adaptive" if any(d > 0 for d in profile.delays_ms) else "initial"
    caps = memory_caps(profile, memory_limit)
    cands = _candidates(profile, schedule, mode, slack_floor, caps, cap_inflight)
    if not candidates:
        cands = cands[:1]
    with gc_paused():
        makespan, best, order, timed = _fastest(profile, cands, full, hold_margin)
        limit = list(best.inflight_limit)
        if validate:
            peak = validate_plan(order, profile.num_stages, profile.num_microbatches, inflight_limit=limit,
                                 release=profile.release,
                                 torch_dry_run=validate == "torch")
        else:
            peak = None  # make_result counts them
        result = make_result(
            order, ops_checked=True, inflight=peak, schedule=schedule,
            source=schedule if len(cands) == 1 else f"{schedule}:{best.name}",
            predicted_makespan_ms=to_ms(makespan), plan_ms=0.0,
            stage_to_rank=range(profile.num_stages), profile=profile, inflight_limit=limit,
            notes=_notes(profile, schedule, mode, slack_floor), candidates=timed,
        )
    result.plan_ms = (time.perf_counter() - t0) * 1e3
    return result
