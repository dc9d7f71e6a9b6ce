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
from dataclasses import dataclass, field
from typing import Any, Sequence

from .ir import Op, gc_paused, to_torch_plan, torch_schedules
from .profile import PipelineProfile
from .timing import LinkQueues, to_ms, to_ns
from .warmup import (
    adapted_warmup_counts,
    initial_warmup_counts_for,
    slackness,
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
    S, N = profile.num_stages, profile.num_microbatches
    x = [int(v) for v in warmup_counts]
    if len(x) != S:
        raise ValueError(f"warmup_counts has {len(x)} entries, expected num_stages = {S}")
    for i, v in enumerate(x):
        if not 1 <= v <= N:
            raise ValueError(f"warmup_counts[{i}] = {v} must be within 1..num_microbatches ({N})")
    if inflight_limit is None:
        limit = [N] * S
    elif isinstance(inflight_limit, int):
        limit = [inflight_limit] * S
    else:
        limit = [int(v) for v in inflight_limit]
    if len(limit) != S or min(limit) < 1:
        raise ValueError(f"inflight_limit must be >= 1 per stage, got {inflight_limit!r}")
    for i in range(S):
        if x[i] > limit[i]:
            raise ValueError(f"warmup_counts[{i}] = {x[i]} exceeds inflight_limit[{i}] = {limit[i]}")

    tf = [to_ns(v) for v in profile.f_ms]
    tb = [to_ns(v) for v in profile.b_ms]
    tw = [to_ns(v) for v in profile.w_ms]
    if full_backward:
        tb = [b + w for b, w in zip(tb, tw)]
    links = LinkQueues(profile.links)

    # Arrival queues per stage, (ready_ns, mb), FIFO: each stage consumes a kind in microbatch order.
    f_q: list[deque] = [deque() for _ in range(S)]
    b_q: list[deque] = [deque() for _ in range(S)]
    w_q: list[deque] = [deque() for _ in range(S)]
    f_q[0].extend((0, m) for m in range(N))
    free_at = [0] * S
    warm_left = list(x)
    f_count = [0] * S
    b_count = [0] * S
    remaining = (2 if full_backward else 3) * N * S
    order: dict[int, list[Op]] = {i: [] for i in range(S)}
    makespan = 0

    wake: list[tuple[int, int]] = [(0, i) for i in range(S)]
    while remaining:
        if not wake:
            raise RuntimeError("generator stalled: no stage can make progress")  # unreachable
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
        elif f_q[i] and f_q[i][0][0] <= t and f_count[i] - b_count[i] < limit[i]:
            kind = "F"
        elif w_q[i] and w_q[i][0][0] <= t:
            kind = "W"
        if kind is None:
            continue  # idle until an arrival wakes it
        if kind == "F":
            _, m = f_q[i].popleft()
            done = t + tf[i]
            f_count[i] += 1
            if i + 1 < S:
                arrive = links.send(i, (i, 1), done)
                f_q[i + 1].append((arrive, m))
                heapq.heappush(wake, (arrive, i + 1))
            else:
                b_q[i].append((done, m))
        elif kind == "I":
            _, m = b_q[i].popleft()
            done = t + tb[i]
            b_count[i] += 1
            if full_backward:
                kind = "B"
            else:
                w_q[i].append((done, m))
            if i > 0:
                arrive = links.send(i - 1, (i, -1), done)
                b_q[i - 1].append((arrive, m))
                heapq.heappush(wake, (arrive, i - 1))
        else:
            _, m = w_q[i].popleft()
            done = t + tw[i]
        order[i].append((i, kind, m))
        makespan = max(makespan, done)
        free_at[i] = done
        remaining -= 1
        heapq.heappush(wake, (done, i))
    return GeneratedSchedule(order, to_ms(makespan))


@dataclass
class Plan:
    """A validated compute-only plan and how it was made."""

    actions: dict[int, list[Any]]  # rank → list[torch _Action]
    warmup_counts: list[int]
    inflight_limit: list[int]
    schedule: str
    plan_ms: float
    predicted_makespan_ms: float
    ops: dict[int, list[Op]] = field(repr=False)

    @property
    def slackness(self) -> list[int]:
        return slackness(self.warmup_counts)


SCHEDULES = ("pipemorph", "zb", "zb-h1")
BACKWARDS = ("split", "full")


def plan_pipemorph(
    profile: PipelineProfile,
    *,
    schedule: str = "pipemorph",
    mode: str = "auto",
    slack_floor: int = 2,
    memory_limit: int | None = None,
    cap_inflight: bool = True,
    validate: bool = True,
    backward: str = "split",
) -> Plan:
    """Plan warm-up counts and generate the full schedule; the returned plan has passed validation.

    ``schedule="zb"``: the ZeroBubble plan of PipeMorph Fig.4, x_i = 2(S − i) − 1, generated as if no
    link were slow. ``schedule="zb-h1"``: minimal warm-up x_i = S − i (1F1B's memory), likewise.
    ``schedule="pipemorph"``: ``mode="initial"`` → Alg.1 under ``memory_limit`` (or the profile's memory
    budget; N when neither); ``mode="adaptive"`` → Alg.2 from the profile's measured times and delays;
    ``mode="auto"`` → adaptive when any link has a delay, else initial.
    ``cap_inflight`` (our memory extension): cap each stage's in-flight activations at its x_i.
    ``backward="full"`` (our extension): plan with the profile's ``fused()`` times (B + W in one full
    backward) and emit full-backward B actions instead of I/W — for hardware where the split costs more
    compute than the W bubble-filling saves (the runtime measures both, see ``titan_ext.runtime``).
    """
    from .validate import validate_plan  # local: validate imports this module's neighbours

    if validate:
        torch_schedules()  # import torch's IR before the clock starts: plan_ms measures planning only
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    t0 = time.perf_counter()
    S = profile.num_stages
    if backward == "full":
        profile = profile.fused()
    gen_profile = profile
    if schedule in ("zb", "zb-h1"):
        x = zb_warmup_counts(S, profile.num_microbatches) if schedule == "zb" else zb_h1_warmup_counts(S)
        if memory_limit is not None:
            x = [min(v, memory_limit) for v in x]
        gen_profile = profile.with_links(())
    elif schedule == "pipemorph":
        if mode == "auto":
            mode = "adaptive" if any(d > 0 for d in profile.delays_ms) else "initial"
        if mode == "initial":
            x = initial_warmup_counts_for(profile, memory_limit)
        elif mode == "adaptive":
            x = adapted_warmup_counts(profile, slack_floor=slack_floor, memory_limit=memory_limit)
        else:
            raise ValueError(f"mode must be auto, initial or adaptive, got {mode!r}")
    else:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    limit = list(x) if cap_inflight else [memory_limit or profile.num_microbatches] * S
    limit = [max(v, xi) for v, xi in zip(limit, x)]
    with gc_paused():
        generated = generate_order(gen_profile, x, limit, full_backward=backward == "full")
        if validate:
            validate_plan(generated.order, S, profile.num_microbatches, inflight_limit=limit)
        actions = to_torch_plan(generated.order)
    plan_ms = (time.perf_counter() - t0) * 1e3
    return Plan(
        actions=actions,
        warmup_counts=x,
        inflight_limit=limit,
        schedule=schedule,
        plan_ms=plan_ms,
        predicted_makespan_ms=generated.makespan_ms,
        ops=generated.order,
    )
