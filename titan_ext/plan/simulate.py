"""Performance model of any compute-only plan (DESIGN.md "Timing model"; PipeMorph §3.2, CrossPipe §3.5).

Each rank runs its actions in program order. An action starts when its rank is free and its inputs
are there (the one rule, ``deps.producers``): F needs the previous stage's F of the same microbatch
(its message, when that stage lives on another rank); I / full B needs its own F and the next stage's
I/B gradient; W needs its own I.
Messages follow ``timing.LinkQueues`` (α + size·β, one message per direction at a time).

``hol=False`` (delegated): sends are asynchronous, compute never waits on a send.
``hol=True`` (PipeMorph §3.2, head-of-line blocking): communication is launched in program order on
the compute stream, so a rank whose action sends a message cannot start its next action until that
message has been delivered.

Durations: F → t_F, I → t_B, W → t_W, full B → t_B + t_W of the stage.
Bubble rate = 1 − Σ busy / (ranks · T), T from the first start to the last end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..args import ArgumentTypeError, int_arg, plan_arg
from .profile import profile_arg
from .complete import check_complete
from .deps import KIND_INDEX, ROOT, class_of, done_key, producers, table
from .ir import Op, TimedAction, as_ops, stage_to_rank_map
from .placement import stage_profile
from .profile import LinkProfile, PipelineProfile
from .result import peak_inflight, peak_memory_per_rank
from .timing import LinkQueues, bubble_rate, to_ms, to_ns


class DeadlockError(ValueError):
    """The plan cannot run to completion: some rank waits forever."""


@dataclass(init=False, unsafe_hash=True)
class ActionEvent(TimedAction):
    """A simulated action: the one record (``ir.TimedAction``) on ``rank``, times in ms from the plan's
    start (``start_ms`` / ``end_ms``); constructed ``ActionEvent(rank, stage, kind, microbatch, start_ms,
    end_ms)``."""

    rank: int = 0

    def __init__(self, rank: int, stage: int, kind: str, microbatch: int, start_ms: float, end_ms: float):
        TimedAction.__init__(self, stage, kind, microbatch, start_ms, end_ms)
        self.rank = rank

    start_ms = property(lambda self: self.start, doc="start, ms")
    end_ms = property(lambda self: self.end, doc="end, ms")


@dataclass
class Timeline:
    events: list[ActionEvent]
    makespan_ms: float
    bubble_rate: float
    busy_ms: dict[int, float]
    idle_ms: dict[int, float]
    peak_inflight: dict[int, int]  # stage → max activations held (F done − I/B done; profile.release)
    peak_memory_per_rank: dict[int, float] = field(default_factory=dict)  # see peak_memory_per_rank()

    def to_dict(self) -> dict:
        return {
            "makespan_ms": self.makespan_ms,
            "bubble_rate": self.bubble_rate,
            "idle_ms": {str(r): v for r, v in self.idle_ms.items()},
            "peak_inflight": {str(s): v for s, v in self.peak_inflight.items()},
            "peak_memory_per_rank": {str(r): v for r, v in self.peak_memory_per_rank.items()},
        }


def _stage_model(
    profile: PipelineProfile, placement: Mapping[int, int], num_ranks: int
) -> tuple[dict[str, list[int]], list[LinkProfile]]:
    """Per-stage durations (ns) and per-stage-boundary links for the plan's placement.

    A stage-level profile (one entry per plan stage) is used as is. A rank-level profile (one entry
    per rank) serves multi-chunk plans (Interleaved, ZBV, DualPipeV, CrossWave): each of a rank's
    ``V`` stages takes 1/V of the rank's times, and a boundary between stages on adjacent ranks
    r, r+1 uses rank link r (the wrap-around boundary of looped schedules, rank S−1 → 0, has none).
    """
    S = len(placement)
    if profile.num_stages == S:
        f, b, w, links = profile.f_ms, profile.b_ms, profile.w_ms, list(profile.links)
    elif profile.num_stages == num_ranks and S % num_ranks == 0:
        staged = stage_profile(profile, [placement[s] for s in range(S)])
        f, b, w, links = staged.f_ms, staged.b_ms, staged.w_ms, list(staged.links)
    else:
        raise ValueError(
            f"profile has {profile.num_stages} stages; the plan has {S} stages on {num_ranks} ranks "
            f"(give one entry per stage, or one per rank)"
        )
    fn, bn, wn = ([to_ns(x) for x in v] for v in (f, b, w))
    return {"F": fn, "I": bn, "W": wn, "B": [x + y for x, y in zip(bn, wn)]}, links


def simulate(
    plan: Mapping[int, Any],
    profile: PipelineProfile,
    *,
    hol: bool = False,
    stage_to_rank: Callable[[int], int] | Mapping[int, int] | None = None,
) -> Timeline:
    """Simulate ``plan`` (rank → compute actions, torch ``_Action`` or tuples) under ``profile``.

    ``profile`` is stage-level (``profile.links[s]`` joins stage s and s+1, unused when both live on
    one rank) or rank-level for multi-chunk plans (see ``_stage_model``). A plan that does not match
    its profile (stage count, microbatch count) or is incomplete (validate.check_complete) raises
    ``ValueError``; one that cannot complete raises ``DeadlockError``.
    """
    profile_arg(profile)
    if not isinstance(hol, bool):
        raise ValueError(f"hol must be True or False, got {hol!r}")
    ops = as_ops(plan_arg(plan))
    placement = stage_to_rank_map(ops)
    if stage_to_rank is not None:
        if isinstance(stage_to_rank, Mapping):
            missing = sorted(set(placement) - set(stage_to_rank))
            if missing:
                raise ValueError(f"stage_to_rank has no rank for stage(s) {missing}")
            lookup = stage_to_rank.__getitem__
        elif callable(stage_to_rank):
            lookup = stage_to_rank
        else:
            raise ArgumentTypeError(f"stage_to_rank must be a mapping stage -> rank, a callable or None, "
                                    f"got {type(stage_to_rank).__name__}")
        for s, r in placement.items():
            if lookup(s) != r:
                raise ValueError(f"stage {s} runs on rank {r} but stage_to_rank says {lookup(s)!r}")
    S = len(placement)
    if set(placement) != set(range(S)):
        raise ValueError(f"plan has stages {sorted(placement)}, expected 0..{S - 1}")
    dur, stage_links = _stage_model(profile, placement, len(ops))
    last_mb = max((m for rank_ops in ops.values() for _, _, m in rank_ops), default=-1)
    if last_mb + 1 != profile.num_microbatches:
        raise ValueError(f"the plan has {last_mb + 1} microbatches, the profile {profile.num_microbatches}")
    check_complete(ops, S, profile.num_microbatches)
    links = LinkQueues(stage_links)
    # messages (deps.table): per class, (link, destination rank) of every rank other than its own where
    # an op needs it; one message per destination rank
    deps = table(S)
    messages: list[list[tuple[int, int]]] = []
    for q in range(3 * S):
        src, out = q // 3, []
        for c in deps.users_of(q):
            dst = placement[c // 3]
            if dst != placement[src] and all(d != dst for _, d in out):
                if abs(c // 3 - src) != 1:
                    raise ValueError(f"stage {c // 3} needs stage {src} on another rank: no link joins them")
                out.append((min(src, c // 3), dst))
        messages.append(out)

    done: dict[Op, int] = {}  # deps.done_key(op) → end ns
    arrived: dict[tuple[Op, int], int] = {}  # (deps.done_key(producer), rank) → arrival ns of its message there
    ranks = sorted(ops)
    pos = {r: 0 for r in ranks}
    free = {r: 0 for r in ranks}
    busy = {r: 0 for r in ranks}
    events: list[ActionEvent] = []
    remaining = sum(len(v) for v in ops.values())

    def ready_time(op: Op) -> int | None:
        """When ``op``'s producers (deps.producers) are done and their messages have arrived."""
        ready, r = 0, placement[op[0]]
        for src in producers(op, S):
            end = done.get(src) if placement[src[0]] == r else arrived.get((src, r))
            if end is None:
                return None
            ready = max(ready, end)
        return ready

    while remaining:
        progressed = False
        for r in ranks:
            rank_ops = ops[r]
            while pos[r] < len(rank_ops):
                op = rank_ops[pos[r]]
                stage, kind, mb = op
                ready = ready_time(op)
                if ready is None:
                    break
                t0 = max(free[r], ready)
                t1 = t0 + dur[kind][stage]
                key = done_key(op)
                done[key] = t1
                free[r] = t1
                busy[r] += t1 - t0
                for link, dst in messages[class_of(stage, kind)]:
                    arrive = links.send(link, (r, dst), t1)
                    arrived[(key, dst)] = arrive
                    if hol:
                        free[r] = max(free[r], arrive)
                events.append(ActionEvent(r, stage, kind, mb, to_ms(t0), to_ms(t1)))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: ops[r][pos[r]] for r in ranks if pos[r] < len(ops[r])}
            raise DeadlockError(f"plan deadlocks: each rank's next action waits forever: {stuck}")

    start = min(e.start_ms for e in events)
    makespan = max(e.end_ms for e in events) - start
    busy_ms = {r: to_ms(v) for r, v in busy.items()}
    idle_ms = {r: makespan - b for r, b in busy_ms.items()}
    bubble = bubble_rate(sum(busy_ms.values()), len(ranks), makespan) if makespan > 0 else 0.0
    return Timeline(events, makespan, bubble, busy_ms, idle_ms, peak_inflight(ops, profile.release),
                    peak_memory_per_rank(ops, release=profile.release))


def replay_makespan_ns(
    order: Mapping[int, list[Op]], profile: PipelineProfile, bound_ns: int | None = None
) -> int | None:
    """``simulate``'s makespan (ns, hol=False) of a one-stage-per-rank plan (stage i on rank i), without
    building a timeline: the same rules, the same visiting order (so the same FIFO link order), on flat
    lists. None as soon as the makespan is certain to exceed ``bound_ns`` (an action ends at t and its
    rank has more than ``bound_ns − t`` of work left). Tests check it bit-for-bit against ``simulate``;
    the planner uses it to time candidates."""
    plan_arg(order, "order")
    profile_arg(profile)
    int_arg(bound_ns, "bound_ns", optional=True)
    S, N = profile.num_stages, profile.num_microbatches
    tf, tb, tw = ([to_ns(v) for v in times] for times in (profile.f_ms, profile.b_ms, profile.w_ms))
    dur = {"F": tf, "I": tb, "W": tw, "B": [b + w for b, w in zip(tb, tw)]}
    links = LinkQueues(profile.links)
    bound = float("inf") if bound_ns is None else bound_ns
    work = [sum(dur[k][s] for _, k, _ in order[s]) for s in range(S)]  # left per rank
    # the dependency table (deps.table): inp[q][m] = when op (q, m)'s trigger has reached its stage (None:
    # not yet); an op of class q ends, then writes its end (same stage) or its message's arrival into
    # inp[c][m] of every class c it feeds. Per stage and kind: (inp, sends, duration).
    deps = table(S)
    inp = [[0] * N if t == ROOT else [None] * N for t in deps.trigger]
    sends = [tuple((inp[c], deps.link[c], (q // 3, c // 3)) for c in deps.feeds_of(q)) for q in range(3 * S)]
    step = [{k: (inp[3 * s + KIND_INDEX[k]], sends[3 * s + KIND_INDEX[k]], dur[k][s]) for k in dur} for s in range(S)]
    pos, free = [0] * S, [0] * S
    remaining = sum(len(order[s]) for s in range(S))
    makespan = 0
    while remaining:
        progressed = False
        for s in range(S):
            ops, p, t, kinds = order[s], pos[s], free[s], step[s]
            while p < len(ops):
                _, kind, m = ops[p]
                ready, out, d = kinds[kind]
                ready = ready[m]
                if ready is None:
                    break
                t = (t if t > ready else ready) + d
                for dst, link, ch in out:
                    dst[m] = t if link < 0 else links.send(link, ch, t)
                work[s] -= d
                if t + work[s] > bound:
                    return None
                if t > makespan:
                    makespan = t
                p += 1
            if p != pos[s]:
                remaining -= p - pos[s]
                pos[s], free[s] = p, t
                progressed = True
        if not progressed:
            stuck = {s: order[s][pos[s]] for s in range(S) if pos[s] < len(order[s])}
            raise DeadlockError(f"plan deadlocks: each rank's next action waits forever: {stuck}")
    return makespan
