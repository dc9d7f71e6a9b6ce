"""Plan-level cases shared by several test files (a helper module, not a test file): CrossPipe's
reference profiles (8 ranks, 16 micro-batches, two data centres joined by rank link 3), random
CrossPipe problems, and plan mutations (valid or deliberately broken plans) for the validator fuzz.

Users: test_crosspipe_greedy.py, test_crosspipe_search.py, test_crosspipe_engine.py,
test_plan_candidates.py, test_plan_pipemorph_c.py. Pure (plan/ only)."""

from __future__ import annotations

import random

from titan_ext.plan import LinkProfile, PipelineProfile
from titan_ext.plan.crosspipe import wave_stage_to_rank
from titan_ext.plan.result import rank_peak_inflight
from titan_ext.plan.placed import PlacedProfile

S, N, TF = 8, 16, 10.0
DC_LINK = S // 2 - 1  # 2 DCs of S/2 stages: the DC boundary is rank link 3 (CrossPipe §5.1, §7.1)
RATIOS = [(lat, bw) for lat in (0.0, 0.5, 2.0) for bw in (0.0, 0.5, 2.0)]


def _link(lat_ratio: float, bw_ratio: float) -> LinkProfile:
    """T_lat = lat_ratio·T_F, T_bw = size·β = bw_ratio·T_F (100 MB messages)."""
    if bw_ratio == 0:
        return LinkProfile(latency_ms=lat_ratio * TF)
    return LinkProfile(latency_ms=lat_ratio * TF, bandwidth_bytes_per_s=1e8 / (bw_ratio * TF / 1e3), message_bytes=1e8)


def ud_profile(lat: float, bw: float, links=(DC_LINK,)) -> PipelineProfile:
    L = [LinkProfile()] * (S - 1)
    for i in links:
        L[i] = _link(lat, bw)
    return PipelineProfile(S, N, TF, TF, TF, tuple(L))


def wave_profile(lat: float, bw: float, rank_links=(DC_LINK,)) -> PipelineProfile:
    """The same model cut in 2S chunks (half the time each), V-shape; a slow rank link slows both
    stage boundaries that cross it."""
    s2r = wave_stage_to_rank(S)
    L = [LinkProfile()] * (2 * S - 1)
    for b in range(2 * S - 1):
        if any({s2r[b], s2r[b + 1]} == {r, r + 1} for r in rank_links):
            L[b] = _link(lat, bw)
    return PipelineProfile(2 * S, N, TF / 2, TF / 2, TF / 2, tuple(L))


def rank_peaks(plan) -> list[int]:
    """Peak in-flight activations per rank (all its stages together), by rank: ``plan.result.rank_peak_inflight``."""
    return list(rank_peak_inflight(plan).values())


def link(latency_ms: float = 0.0, transfer_ms: float = 0.0, message_bytes: float = 1e6) -> LinkProfile:
    """A link of latency α and transfer time size·β (ms) for ``message_bytes`` messages."""
    if transfer_ms == 0:
        return LinkProfile(latency_ms=latency_ms)
    return LinkProfile(latency_ms=latency_ms, bandwidth_bytes_per_s=message_bytes / (transfer_ms / 1e3),
                       message_bytes=message_bytes)


def placed(s2r, num_microbatches: int, f, b, w, latency=(), transfer=(), memory_limit=None,
           release: str = "I") -> PlacedProfile:
    """A :class:`PlacedProfile` from per-stage times and per-boundary α / size·β (ms; empty: none)."""
    S = len(s2r)
    latency = tuple(latency) or (0.0,) * (S - 1)
    transfer = tuple(transfer) or (0.0,) * (S - 1)
    links = tuple(link(a, t) for a, t in zip(latency, transfer))
    return PlacedProfile(PipelineProfile(S, num_microbatches, tuple(f), tuple(b), tuple(w), links, release=release),
                         tuple(s2r), memory_limit)


def uniform_placed(num_ranks: int, num_microbatches: int, f_ms: float, b_ms: float, w_ms: float, *,
                   wave: bool = False, latency_ms=0.0, transfer_ms=0.0, memory_limit=None,
                   release: str = "I") -> PlacedProfile:
    """Uniform per-stage times on one stage per rank (``wave``: 2R stages, V-shape); ``latency_ms`` /
    ``transfer_ms`` one value for every rank link or ``{rank link: ms}``; ``memory_limit`` one number for
    every rank or one per rank."""
    s2r = wave_stage_to_rank(num_ranks) if wave else tuple(range(num_ranks))
    S = len(s2r)

    def per_link(v):
        out = [0.0] * (S - 1)
        items = v.items() if isinstance(v, dict) else ((k, v) for k in range(num_ranks - 1))
        for k, x in items:
            for s in range(S - 1):
                if {s2r[s], s2r[s + 1]} == {k, k + 1}:
                    out[s] = float(x)
        return tuple(out)

    if memory_limit is not None and isinstance(memory_limit, (int, float)):
        memory_limit = [float(memory_limit)] * num_ranks
    return placed(s2r, num_microbatches, (f_ms,) * S, (b_ms,) * S, (w_ms,) * S, per_link(latency_ms),
                  per_link(transfer_ms), memory_limit, release)


def random_problem(rng: random.Random, wave: bool) -> PlacedProfile:
    ranks = rng.randint(2, 5)
    stages = 2 * ranks if wave else ranks
    micro = rng.randint(stages, stages + 8)
    return placed(
        wave_stage_to_rank(ranks) if wave else tuple(range(ranks)), micro,
        f=tuple(rng.uniform(1, 10) for _ in range(stages)),
        b=tuple(rng.uniform(1, 10) for _ in range(stages)),
        w=tuple(rng.choice([0.0, rng.uniform(1, 10)]) for _ in range(stages)),
        latency=tuple(rng.choice([0.0, 2.0, 25.0]) for _ in range(stages - 1)),
        transfer=tuple(rng.choice([0.0, 1.0, 15.0]) for _ in range(stages - 1)),
        memory_limit=tuple(float(rng.randint(2 if wave else 1, 2 * stages)) for _ in range(ranks)),
    )


def mutate(rng: random.Random, ops: dict, S: int):
    """A valid plan, or one deliberately broken: dropped op, swapped dependency, reordered ranks
    (cross-rank deadlocks among them), or a memory limit below the plan's peak."""
    ops = {r: list(v) for r, v in ops.items()}
    kind = rng.choice(["valid", "drop", "swap-dep", "reorder", "memory"])
    limit = None
    if kind == "drop":
        r = rng.randrange(S)
        ops[r].pop(rng.randrange(len(ops[r])))
    elif kind == "swap-dep":  # put a consumer before its producer on the same rank
        r = rng.randrange(S)
        p = rng.randrange(len(ops[r]))
        s, k, m = ops[r][p]
        need = {"I": "F", "B": "F", "W": "I"}.get(k)
        if need:
            q = ops[r].index((s, need, m))
            ops[r][p], ops[r][q] = ops[r][q], ops[r][p]
    elif kind == "reorder":  # move one op elsewhere on its rank: often a cross-rank deadlock
        r = rng.randrange(S)
        op = ops[r].pop(rng.randrange(len(ops[r])))
        ops[r].insert(rng.randrange(len(ops[r]) + 1), op)
    elif kind == "memory":
        peak = max(max(0, *_running_held(v)) for v in ops.values())
        limit = max(1, peak - rng.choice([0, 1]))
    return kind, ops, limit


def _running_held(rank_ops):
    held = 0
    for _, k, _ in rank_ops:
        held += {"F": 1, "I": -1, "B": -1}.get(k, 0)
        yield held
