"""Independent references the tests and benchmarks share: algorithms written literally from their papers,
slow on purpose, against which the fast planners are checked (tests) and timed (benchmarks).

* :func:`alg4_literal` -- PipeMorph Alg.4 (§4.3) as published: a discrete-time loop with step δ; every
  step visits each stage, and an idle stage picks an operation with Alg.3 among those whose inputs have
  arrived. The event-driven generator (``plan.pipemorph.generate_order``) must give the same order
  (tests/plan/test_plan_generator.py); scripts/bench_planner.py times it as the paper's baseline.
"""

from __future__ import annotations

from typing import Sequence


def _lowest_ready(queue: list[tuple[float, int]], t: float) -> int | None:
    """The lowest microbatch whose input has arrived by ``t`` (Alg.3: lowest microbatch first)."""
    best = None
    for ready, m in queue:
        if ready <= t and (best is None or m < best):
            best = m
    return best


def alg4_literal(tf: Sequence[float], tb: Sequence[float], tw: Sequence[float], c: Sequence[float], N: int,
                 x: Sequence[int], limit: Sequence[int], delta: float = 1):
    """PipeMorph Alg.4 with Alg.3's choice, written literally (latency-only links ``c``; stage i's F, I, W
    take ``tf[i]``, ``tb[i]``, ``tw[i]``): at t = 0, δ, 2δ ... each idle stage i picks, among the
    operations whose inputs have arrived, a warm-up F while its quota ``x[i]`` lasts, then I > F > W (F only
    while fewer than ``limit[i]`` activations are held), lowest microbatch first.  Integer times with
    δ = 1 are exact.  Returns (per-stage orders of ``(stage, kind, microbatch)``, the last end time)."""
    S = len(tf)
    avail = [{"F": [], "I": [], "W": []} for _ in range(S)]  # per stage and kind: (ready time, microbatch)
    avail[0]["F"] = [(0, m) for m in range(N)]
    busy_until = [0] * S
    quota, held = list(x), [0] * S
    order: list[list[tuple[int, str, int]]] = [[] for _ in range(S)]
    end_time, left, step = 0, 3 * N * S, 0
    while left:
        t = step * delta
        for i in range(S):
            if busy_until[i] > t:
                continue
            ready = {k: _lowest_ready(q, t) for k, q in avail[i].items()}
            pick = None
            if quota[i] > 0:
                if ready["F"] is not None:
                    pick = "F"
                    quota[i] -= 1
            elif ready["I"] is not None:
                pick = "I"
            elif ready["F"] is not None and held[i] < limit[i]:
                pick = "F"
            elif ready["W"] is not None:
                pick = "W"
            if pick is None:
                continue
            m = ready[pick]
            avail[i][pick] = [(r, mm) for r, mm in avail[i][pick] if mm != m]
            done = t + {"F": tf, "I": tb, "W": tw}[pick][i]
            busy_until[i] = done
            end_time = max(end_time, done)
            order[i].append((i, pick, m))
            left -= 1
            if pick == "F":
                held[i] += 1
                if i + 1 < S:
                    avail[i + 1]["F"].append((done + c[i], m))
                else:
                    avail[i]["I"].append((done, m))
            elif pick == "I":
                held[i] -= 1
                avail[i]["W"].append((done, m))
                if i > 0:
                    avail[i - 1]["I"].append((done + c[i - 1], m))
        step += 1
    return order, end_time
